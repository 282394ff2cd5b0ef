"""The one redaction of credentials that every message of the library and the CLI uses.

Plain text in, plain text out: no torch, no object-store client. ``redact_text``
hides the user part of URLs (with or without a scheme), secret query parameters
and any secret values its caller knows of; ``redact_url`` is the same for one
URL; ``url_secrets`` pulls the user and password out of URLs (the CLI hides
them wherever else they show up); ``redact`` hides given values only; and
``known_secrets`` lists the values an object-store client for a URL may echo
(credential environment variables, secret options, the URL's own user part).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["known_secrets", "redact", "redact_text", "redact_url", "url_secrets"]

# Environment variables whose values are credentials; their values are redacted
# from every message even when the client library does not report them.
_SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
)
_SECRET_OPTION = re.compile(r"(secret|key|token|password|sas|credential|signature)", re.I)


# The user part of a URL: after ``scheme://`` (or ``scheme:/``, as ``Path`` prints a URL
# taken for a path) up to the ``@``: ``user@`` or ``user:password@``. A password may hold
# an unencoded ``/``; a ``/`` before any ``:`` is a path (``hf://datasets/x@main``).
_URL_USERINFO = re.compile(
    r"(\b[A-Za-z][A-Za-z0-9+.-]*:/{1,2})(?:[^\s'\"<>@/:]*:[^\s'\"<>@]+|[^\s'\"<>@/:]+)@"
)
# ``KEY:SECRET@host`` without a scheme (``durable="KEY:SECRET@bucket/p"``).
_BARE_USERINFO = re.compile(r"(?<![^\s'\"<>(=,])[^\s'\"<>@:/(=,]+:(?!/)[^\s'\"<>@]+@")
# Signed or token-carrying query parameters (S3 presigned URLs, Azure SAS, OAuth tokens).
_SECRET_QUERY = re.compile(
    r"([?&;](?:[A-Za-z0-9_.-]*(?:secret|key|token|password|passwd|credential|signature)"
    r"[A-Za-z0-9_.-]*|sig|sv|se|sp|skoid|sktid)=)[^&;#\s'\"<>]+",
    re.I,
)


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential stalwart can recognise replaced by ``***``.

    The one redaction of the library and the CLI: the user part of URLs
    (``s3://KEY:SECRET@bucket`` -> ``s3://***@bucket``, also ``KEY:SECRET@bucket``
    without a scheme), secret query parameters (``X-Amz-Signature=``, ``sig=``,
    ``token=``, ...) and every string of ``secrets`` (4 characters or more). The
    clients add the values of credential environment variables (``redact``); they
    are not hidden here, where a short one (``test``) would mangle paths. Pure;
    safe to apply twice.
    """
    text = _URL_USERINFO.sub(r"\1***@", text)
    text = _BARE_USERINFO.sub("***@", text)
    text = _SECRET_QUERY.sub(r"\1***", text)
    return redact(text, secrets)


def redact_url(url: str) -> str:
    """``url`` without credentials (``s3://KEY:SECRET@bucket`` -> ``s3://***@bucket``); see
    ``redact_text``, which this is."""
    return redact_text(url)


def url_secrets(text: str) -> list[str]:
    """The user and password parts of every URL (or bare ``KEY:SECRET@host``) in ``text``:
    the exact strings to hide wherever else they show up (a path that mangled the URL)."""
    found: list[str] = []
    for match in (*_URL_USERINFO.finditer(text), *_BARE_USERINFO.finditer(text)):
        userinfo = match.group(0)[len(match.group(1)) if match.groups() else 0 : -1]
        # The whole, user and password, and the pieces of a password with a "/" in it (a
        # path splits it there).
        found += [userinfo, *userinfo.split(":", 1), *re.split(r"[:/]", userinfo)]
    found = [part for part in found if part]
    return found


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret value (at least 4 characters long) replaced by ``***``."""
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def known_secrets(url: str, options: Mapping[str, Any]) -> list[str]:
    """The credential values an object-store client for ``url`` with ``options`` may echo.

    The values of the credential environment variables (``AWS_SECRET_ACCESS_KEY``,
    ...), of every option whose name says secret, key, token, password, SAS,
    credential or signature, and the user and password of ``url``: what a client
    passes to ``redact_text`` as ``secrets``. Reads the environment at call time.
    """
    secrets = [os.environ.get(name, "") for name in _SECRET_ENV]
    secrets += [str(v) for k, v in options.items() if _SECRET_OPTION.search(k)]
    parts = urlsplit(url)
    if parts.password:
        secrets.append(parts.password)
    if parts.username and parts.password:
        secrets.append(parts.username)
    return secrets
