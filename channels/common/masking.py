"""Keeping secrets out of what the operator is shown: config errors and ``chatbridge check``'s output.

Two rules, applied together by :func:`mask`:
- the value of every secret key (``api_key``, tokens, an MCP server's ``env``) is replaced by ``***``
  wherever it appears as a whole (not inside a longer word) — also when the same value was pasted into a
  key that is not secret;
- a string that looks like a credential is replaced by ``***`` even when it is not the value of any secret
  key: a secret pasted into the wrong key (``port = "sk-…"``) is exactly that case.

"Looks like a credential" (:func:`looks_secret`): the shapes providers give their keys (``sk-…``,
``xoxb-…``, ``ghp_…``, a Telegram bot token ``123456:ABC…``, a JWT), a run of 32 or more hex digits, or a
random-looking token: 24 or more letters, digits, ``-`` and ``_`` mixing upper and lower case and digits,
with 16 or more letters and digits in a row (model names and paths have words between their separators;
keys do not). No rule of this kind is complete; it errs towards hiding a harmless value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"

_SHAPES = re.compile(
    r"""(?x)
    \b(?:sk|pk|rk)[-_][A-Za-z0-9_-]{12,}                 # OpenAI, Anthropic (sk-ant-), Stripe-like keys
    | \bxox[abposr]-[A-Za-z0-9-]{10,}                   # Slack bot/user tokens
    | \bxapp-[A-Za-z0-9-]{10,}                          # Slack app-level tokens
    | \b(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]{20,}     # GitHub
    | \bglpat-[A-Za-z0-9_-]{20,}                        # GitLab
    | \bhf_[A-Za-z0-9]{20,}                             # Hugging Face
    | \bAKIA[0-9A-Z]{16}\b                              # AWS access key id
    | \bAIza[0-9A-Za-z_-]{30,}                          # Google API key
    | \b\d{5,}:[A-Za-z0-9_-]{30,}                       # Telegram bot token
    | \beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]*)?   # JWT
    | (?<![A-Za-z0-9])[0-9a-fA-F]{32,}(?![A-Za-z0-9])   # hex secrets
    """
)
_TOKEN = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{24,}(?![A-Za-z0-9_-])")
_RUN = re.compile(r"[A-Za-z0-9]{16,}")


def _random_looking(token: str) -> bool:
    return (any(c.isupper() for c in token) and any(c.islower() for c in token)
            and any(c.isdigit() for c in token)
            and any(any(c.isdigit() for c in run) and any(c.isalpha() for c in run)
                    for run in _RUN.findall(token)))


def looks_secret(text: str) -> bool:
    """True when ``text`` contains something shaped like a credential (see the module docstring)."""
    return _SHAPES.search(text) is not None or any(_random_looking(m) for m in _TOKEN.findall(text))


def mask(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every value of ``secrets`` and everything that looks like a credential as ``***``."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        # whole values only: a short secret ("x") must not eat the letters of every word around it
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", MASK, text)
    text = _SHAPES.sub(MASK, text)
    return _TOKEN.sub(lambda m: MASK if _random_looking(m.group()) else m.group(), text)
