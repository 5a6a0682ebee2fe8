"""A model folder's chat template, rendered as transformers renders it (``LLM.chat``, the
server's chat completions and ``/tokenize``)."""

from __future__ import annotations

import inspect
import json
import os

from sfjax import checks as C
from sfjax.config import read_json
from sfjax.tokenizer import encode

ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatTemplate:
    """The folder's chat template (``chat_template.jinja``, as transformers 5 saves it, or
    ``chat_template`` in tokenizer_config.json), rendered through transformers; ``render``
    raises ValueError naming ``messages`` for a folder without one or a message it cannot
    take."""

    def __init__(self, path: str):
        self.path = path
        file = os.path.join(path, "tokenizer_config.json")
        config = read_json(file) if os.path.isfile(file) else {}
        self.available = (bool(config.get("chat_template"))
                          or os.path.isfile(os.path.join(path, "chat_template.jinja")))
        self._tokenizer = None

    def prompt(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True,
               variables: dict | None = None, add_special_tokens: bool = False) -> dict:
        """The conversation as an engine prompt: ``render``'s text and its ids (``LLM.chat``,
        the server's chat and ``/tokenize``)."""
        text = self.render(messages, add_generation_prompt, variables)
        return {"prompt": text, "prompt_token_ids": encode(tokenizer, text, add_special_tokens)}

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               variables: dict | None = None) -> str:
        """The conversation's text; ``variables``: vLLM's ``chat_template_kwargs``, more names
        the template reads (e.g. Qwen3's ``enable_thinking``)."""
        if not self.available:
            raise ValueError("messages: this model has no chat template (no chat_template.jinja, "
                             "no chat_template in its tokenizer_config.json)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: must be a non-empty list of {'role', 'content'} dicts")
        messages = [_message(m, i) for i, m in enumerate(messages)]
        if self._tokenizer is None:     # transformers loads only when chat is used
            from transformers import PreTrainedTokenizerFast
            self._tokenizer = PreTrainedTokenizerFast.from_pretrained(self.path)
        variables = _variables(variables, self._tokenizer.apply_chat_template)
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:           # jinja's TemplateError and the like
            raise ValueError(f"messages: the chat template failed: {e}") from None


def _variables(variables, apply) -> dict:
    """``chat_template_kwargs`` as the template's variables: a dict by name, none of them a
    parameter of transformers' ``apply_chat_template`` itself (``tokenize``, ``tools``, ...)."""
    if variables is None:
        return {}
    if not isinstance(variables, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                  for k in variables):
        raise ValueError("chat_template_kwargs: must be a dict of the template's variables by name")
    own = sorted(set(variables) & set(inspect.signature(apply).parameters))
    if own:
        raise ValueError(f"chat_template_kwargs: {own[0]!r} is not offered (a parameter of the "
                         f"rendering, not a variable of the template)")
    return variables


# what a message may carry beside role and content, given to the template as vLLM gives it
PASSED = ("name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning")


def _message(m, i: int) -> dict:
    """A message as the template gets it: its content as one string (its non-empty text parts
    joined by newlines, as vLLM joins them for templates that take a string; None beside
    tool_calls is ""), and the fields of ``PASSED`` it has, each tool call's arguments as a
    dict (JSON text decoded, as vLLM does). Fields that are None are left out; any other field
    is refused naming it (dropping it would change the prompt without a word)."""
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}]: must be a dict with 'role' and 'content', got "
                         f"{type(m).__name__}")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
    other = sorted(k for k, v in m.items() if v is not None and k not in ("role", "content", *PASSED))
    if other:
        raise ValueError(f"messages[{i}].{other[0]}: not offered (a message takes role, content, "
                         f"{', '.join(PASSED)})")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text"
               or not isinstance(p.get("text", ""), str) for p in content):
            raise ValueError(f"messages[{i}].content: only text parts (each a str) are offered")
        content = "\n".join(p["text"] for p in content if p.get("text"))
    if content is None and m.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or text parts")
    C.text(f"messages[{i}].content", content)
    out = {"role": role, "content": content}
    for k in PASSED:
        if m.get(k) is not None:
            out[k] = _tool_calls(m[k], i) if k == "tool_calls" else m[k]
            if k != "tool_calls" and not isinstance(out[k], str):
                raise ValueError(f"messages[{i}].{k} must be a string")
    return out


def _tool_calls(calls, i: int) -> list:
    """An assistant message's tool calls, each a copy whose function arguments are a dict."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValueError(f"messages[{i}].tool_calls must be a list of tool call objects")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}].function must be an object with a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: not JSON "
                                 f"({e.msg} at position {e.pos})") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
