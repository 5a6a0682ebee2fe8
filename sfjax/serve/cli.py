"""The ``serve`` subcommand and ``bench --base-url``, hooked into ``sfjax.cli.build_parser``.

Nothing here imports FastAPI, uvicorn or JAX until a subcommand runs, so ``sfjax --help`` stays
quick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading

logger = logging.getLogger("sfjax")


_SERVE_OPTIONS = (     # flag, type, default, help
    ("--host", str, "127.0.0.1", None),
    ("--port", int, 8000, None),
    ("--served-model-name", str, None,
     "the name requests give as 'model' (default: the model argument, or 'sfjax-default')"),
    ("--max-waiting", int, 512,
     "requests admitted beyond --max-num-seqs; more get 503 (retry later)"),
    ("--shutdown-timeout", float, 10.0,
     "on SIGTERM: seconds live requests may take to finish before they end with finish_reason 'abort'"),
)


def add_parser(sub, common) -> None:
    """``sfjax serve [MODEL] [--host] [--port] ...`` with ``common``'s engine flags."""
    s = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat, streaming)",
                       description="Serves MODEL (an HF folder; default: the embedded target, "
                                   "speculating with its n-gram table, adaptive k) over HTTP with "
                                   "OpenAI's API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics, /tokenize, /detokenize.")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder (same as --model)")
    for flag, kind, default, text in _SERVE_OPTIONS:
        s.add_argument(flag, type=kind, default=default, help=text)
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    common(s)
    s.set_defaults(run=run_serve)


def add_bench_args(b: argparse.ArgumentParser, offline) -> None:
    """``sfjax bench --base-url URL`` drives a running server; without it ``offline`` runs."""
    b.add_argument("--base-url", default=None,
                   help="a running sfjax (or OpenAI-compatible) server: benchmark it over HTTP "
                        "with streamed /v1/completions, like vllm bench serve")
    b.add_argument("--max-concurrency", type=int, default=None,
                   help="with --base-url: requests in flight at most (default: all at once)")
    b.add_argument("--request-rate", type=float, default=float("inf"),
                   help="with --base-url: Poisson arrivals per second (default inf: all at t = 0)")
    b.add_argument("--compare-offline", action="store_true",
                   help="with --base-url: also run the same prompts through an offline engine "
                        "built here from the same engine flags, at the same concurrency, and "
                        "print the server / offline output-throughput ratio")

    def run(args):
        if args.base_url is None:
            return offline(args)
        from sfjax.serve.bench import main as bench_main
        return bench_main(args)
    b.set_defaults(run=run)


# seconds past --shutdown-timeout for the aborted requests' last chunks to go out: the drain
# waits ENGINE_GRACE for the engine to report the aborts (it takes them after the step it is in,
# which a compile makes seconds long), then ends what is left itself (``AsyncLLM.shutdown``);
# uvicorn cancels the handlers still open (a client not reading) at ABORT_GRACE
ABORT_GRACE, ENGINE_GRACE = 5.0, 3.0


class _Server:
    """uvicorn's server, exiting 0 after a SIGTERM / SIGINT: uvicorn re-raises the signal once it
    has shut down, which would end the process with the signal's status instead. Its shutdown
    drains the engine (``drain``: live requests finish for --shutdown-timeout, then end with
    finish_reason "abort") while uvicorn waits for the connections, so each client gets its last
    chunk; uvicorn alone cancelled the handlers at its deadline (a plain-text 500, or a stream
    cut without [DONE]) and drained the engine only after that."""

    @staticmethod
    def make(config, drain):
        import uvicorn

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                draining = asyncio.ensure_future(drain())
                try:
                    await super().shutdown(sockets)
                finally:
                    if self.force_exit:      # a second Ctrl-C: no more waiting (run_serve closes)
                        draining.cancel()
                    else:
                        await draining

            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                sigs = (signal.SIGINT, signal.SIGTERM)
                old = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
                try:
                    yield
                finally:
                    for sig, handler in old.items():
                        signal.signal(sig, handler)

        return Server(config)


def check_args(args) -> None:
    """The serve flags, refused naming the flag before the model loads (port 0: one the OS
    picks)."""
    from sfjax.checks import integer, real

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ")
        args.model = args.model_tag
    integer("--port", args.port, 0, 65535)
    integer("--max-waiting", args.max_waiting, 0)
    real("--shutdown-timeout", args.shutdown_timeout, 0.0)


def run_serve(args) -> int:
    check_args(args)
    import uvicorn

    from sfjax.async_llm import AsyncLLM
    from sfjax.cli import _llm
    from sfjax.default_model import default_speculative_config
    from sfjax.serve.app import build_app
    from sfjax.serve.metrics import ServerMetrics

    llm = _llm(args, default_speculative_config() if args.model is None else None)
    if args.precompile:        # before the port opens: no request waits on a compile
        logger.info("sfjax serve: compiled every shape bucket in %.1f s",
                    llm.engine.precompile(progress=True))
    engine = AsyncLLM.from_llm(llm, max_waiting=args.max_waiting)
    name = args.served_model_name or args.model or "sfjax-default"
    metrics = ServerMetrics(engine, name)
    engine.stat_loggers.append(metrics.record)
    app = build_app(engine, name, llm.model_path, metrics, args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE)
    try:
        _Server.make(config, lambda: engine.shutdown(args.shutdown_timeout,
                                                     ENGINE_GRACE)).run()
    finally:
        engine.close()
    logger.info("sfjax serve: stopped")
    return 0
