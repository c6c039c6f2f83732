"""Keep secrets (tokens, passwords, keys) out of MLflow params, config.yaml, run.json and logs.

Secrets belong in the environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or
MLFLOW_TRACKING_TOKEN for MLflow, HF_TOKEN, cloud keys). One written in the config is used by this
process but written everywhere as `***`: values under a key that names a secret, the password in a
URL (`http://user:***@host`), secret query parameters, and the value of any secret environment
variable wherever it appears in a log message.
"""

from __future__ import annotations

import logging
import os
import re
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
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@", re.I)
_QUERY_SECRET = re.compile(
    r"(?P<k>[?&](?:[^=&\s]*?)(?:token|password|passwd|secret|api[_-]?key|access[_-]?key|signature|sig)"
    r"[^=&\s]*=)(?P<v>[^&\s]+)",
    re.I,
)
MIN_ENV_SECRET = 6  # shorter values would mask innocent text


def is_secret_key(key: str) -> bool:
    """True for a config or environment name that holds a secret (the last dotted segment decides)."""
    words = [w for w in re.split(r"[^a-z0-9]+", str(key).rsplit(".", 1)[-1].lower()) if w]
    return any(w in _SECRET_WORDS for w in words) or any(
        p in _SECRET_PAIRS for p in zip(words, words[1:], strict=False)
    )


def _env_secrets() -> list[str]:
    values = {v for k, v in os.environ.items() if is_secret_key(k) and len(v) >= MIN_ENV_SECRET}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str) -> str:
    """URL passwords, secret query parameters and secret environment values replaced by ***."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _QUERY_SECRET.sub(lambda m: f"{m['k']}{MASK}", text)
    for value in _env_secrets():
        text = text.replace(value, MASK)
    return text


def redact(value: Any, key: str = "") -> Any:
    """A copy of a config tree (dicts, lists, scalars) with every secret masked."""
    if isinstance(value, dict):
        return {k: redact(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v, key) for v in value)
    if key and is_secret_key(key) and value not in (None, ""):
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
