"""Writes the code-completion prompts of the demo benchmarks (BENCHMARKS.md, issue 7) as JSON lines.

    python scripts/code_prompts.py --out /tmp/code_prompts.jsonl      # the 8 benchmark prompts

Each prompt is the 240 characters ending with the first ``def ...:`` line of a held-out standard
library file (``scripts/train_demo.py``'s split: every 20th corpus file, never trained on), in
the split's order, skipping files whose first ``def`` line ends before character 240.
``sfjax bench --prompts-file`` reads the file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo  # noqa: E402

CHARS = 240
FIRST_DEF = re.compile(r"^[ \t]*def [^\n]*:[ \t]*\n", re.M)


def code_prompts(count: int, start: int = 0) -> list[str]:
    root, files = train_demo.corpus_files(None)
    held = [f for i, f in enumerate(files) if i % train_demo.HELD_OUT_EVERY == 0]
    prompts = []
    for text in train_demo.read_texts(root, held):
        m = FIRST_DEF.search(text)
        if m is not None and m.end() >= CHARS:
            prompts.append(text[m.end() - CHARS:m.end()])
    return prompts[start:start + count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--start", type=int, default=0, help="skip this many prompts")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count = {args.count}: must be >= 1")
    if args.start < 0:
        parser.error(f"--start = {args.start}: must be >= 0")
    prompts = code_prompts(args.count, args.start)
    with open(args.out, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    print(f"{len(prompts)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
