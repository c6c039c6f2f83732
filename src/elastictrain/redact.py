"""Keep secrets (tokens, passwords, keys) out of MLflow params, config.yaml, run.json and logs.

Secrets belong in the environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or
MLFLOW_TRACKING_TOKEN for MLflow, HF_TOKEN, cloud keys). One written in the config is used by this
process but written everywhere as `***`: values under a key that names a secret, the password in a
URL (`http://user:***@host`, `https://***@host` for a token alone), secret query parameters, and
the value of any secret environment variable. `redact_text` (and `redact` for trees) is the one
masking function: every path to disk (run.json, events.jsonl, the spool), MLflow and the terminal
goes through it, as do log records (their tracebacks included) and uncaught exceptions.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

MASK = "***"
# Whole words of a name (split at '.', '_', '-'): "hf_token" is a secret, "tokenizer" is not.
_SECRET_WORDS = {
    "token",
    "password",
    "passwd",
    "pwd",
    "secret",
    "apikey",
    "credential",
    "credentials",
    "auth",
}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("signing", "key")}
# The userinfo runs to the last '@' before the host: a password may hold '/' or '@' itself.
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<info>[^\s\"'<>?#]*)@(?=[^\s@/?#])", re.I)
_QUERY_SECRET = re.compile(
    r"(?P<k>[?&](?:[^=&\s]*?)(?:token|password|passwd|secret|api[_-]?key|access[_-]?key|signature|sig)"
    r"[^=&\s]*=)(?P<v>[^&\s]+)",
    re.I,
)
MIN_ENV_SECRET = 6  # shorter values would mask innocent text
# The shell's working directories: "pwd" names a password elsewhere, but these hold a folder. Masked,
# every path under the folder a run starts from (nvme_path, run.dir) was written `***/...` into
# config.yaml, and `resume` then refused the run or looked in the wrong place.
_NOT_SECRET_ENV = {"PWD", "OLDPWD"}


def is_secret_key(key: str) -> bool:
    """True for a config or environment name that holds a secret (the last dotted segment decides)."""
    words = [w for w in re.split(r"[^a-z0-9]+", str(key).rsplit(".", 1)[-1].lower()) if w]
    return any(w in _SECRET_WORDS for w in words) or any(
        p in _SECRET_PAIRS for p in zip(words, words[1:], strict=False)
    )


@functools.lru_cache(maxsize=4096)
def _is_secret_env_name(name: str) -> bool:
    return name not in _NOT_SECRET_ENV and is_secret_key(name)


@functools.lru_cache(maxsize=64)
def _longest_first(values: frozenset[str]) -> tuple[str, ...]:
    return tuple(sorted(values, key=len, reverse=True))  # a tuple: the cached answer is shared


def _env_secrets() -> tuple[str, ...]:
    """The secret environment values, longest first. Read at every call (a test or a user may set a
    password later), but each name is judged once: every log record is redacted, and a regex over every
    name at every record is over ten times slower."""
    env = os.environ
    values = frozenset(
        v for k in env if _is_secret_env_name(k) and len(v := env.get(k, "")) >= MIN_ENV_SECRET
    )
    return _longest_first(values)


def _mask_userinfo(m: re.Match[str]) -> str:
    user, colon, _ = m["info"].partition(":")
    # `user:password@` keeps the user; a lone `TOKEN@` (a token used as the user name) is masked whole.
    return f"{m['scheme']}{user}:{MASK}@" if colon else f"{m['scheme']}{MASK}@"


def redact_text(text: str) -> str:
    """URL passwords, secret query parameters and secret environment values replaced by ***."""
    text = _URL_USERINFO.sub(_mask_userinfo, text)
    text = _QUERY_SECRET.sub(lambda m: f"{m['k']}{MASK}", text)
    for value in _env_secrets():
        text = text.replace(value, MASK)
    return text


def redact(value: Any, key: str = "", *, by_key: bool = True) -> Any:
    """A copy of a tree (dicts, lists, scalars) with every string masked by `redact_text`.

    by_key (configs): also every value under a key that names a secret. Records that are not configs
    (events, run.json) are masked by text only: a metric named `token_acc` is not a secret.
    """
    if isinstance(value, dict):
        return {k: redact(v, f"{key}.{k}" if key else str(k), by_key=by_key) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v, key, by_key=by_key) for v in value)
    if by_key and key and is_secret_key(key) and value not in (None, ""):
        return MASK
    if isinstance(value, str):
        return redact_text(value)
    return value


def _redacting(factory: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    """Wrap a record factory so each record's message is redacted where it is made."""

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: leave it for logging's own error report
            return record
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        # Handlers format a traceback only later, from exc_info: format it now, masked (they reuse exc_text).
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            record.exc_text = redact_text("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return record

    make._elastictrain_redacting = True  # type: ignore[attr-defined]
    return make


def install_log_redaction() -> None:
    """Every log record of this process (ours, Ray's, MLflow's) is redacted when it is made.

    Wraps whatever record factory is installed (Ray and others install their own), so the
    redaction survives libraries that set a factory before us; `ensure` again after one sets
    a factory later (the driver calls this after `ray.init`).
    """
    current = logging.getLogRecordFactory()
    if getattr(current, "_elastictrain_redacting", False):
        return
    logging.setLogRecordFactory(_redacting(current))


def _print_masked(exc_type: type[BaseException], exc: BaseException, tb: Any, header: str = "") -> None:
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(header + redact_text(text))
    sys.stderr.flush()


def install_exception_redaction() -> None:
    """Uncaught exceptions, in the main thread or any other, print their traceback masked."""
    if getattr(sys.excepthook, "_elastictrain_redacting", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        _print_masked(exc_type, exc, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:
            return
        name = args.thread.name if args.thread is not None else "?"
        _print_masked(args.exc_type, args.exc_value, args.exc_traceback, f"Exception in thread {name}:\n")

    hook._elastictrain_redacting = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    threading.excepthook = thread_hook
