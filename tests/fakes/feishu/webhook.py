"""Sends event and callback bodies to a webhook URL exactly as Feishu does.

With an ``encrypt_key`` the body is ``{"encrypt": base64(iv + AES-256-CBC(sha256(encrypt_key), iv,
PKCS7(json)))}`` and the request carries ``X-Lark-Request-Timestamp``, ``X-Lark-Request-Nonce`` and
``X-Lark-Signature`` = hex(sha256(timestamp + nonce + encrypt_key + raw body)). Without one the JSON goes in
plain and unsigned; the verification token travels inside (``header.token``, or ``token`` for
``url_verification``).

Options let a test send what an attacker or a misconfigured app would: a wrong token, a bad signature, a
body encrypted with another key or not decryptable at all, a stale timestamp.

AES comes from pycryptodome, which lark-oapi itself uses for decryption (it is installed with it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from Crypto.Cipher import AES

from tests.fakes.feishu import events

SIGNATURE = "X-Lark-Signature"
TIMESTAMP = "X-Lark-Request-Timestamp"
NONCE = "X-Lark-Request-Nonce"


def encrypt(plaintext: str, encrypt_key: str) -> str:
    key = hashlib.sha256(encrypt_key.encode("utf-8")).digest()
    iv = os.urandom(16)
    data = plaintext.encode("utf-8")
    pad = 16 - len(data) % 16
    cipher = AES.new(key, AES.MODE_CBC, iv)
    return base64.b64encode(iv + cipher.encrypt(data + bytes([pad]) * pad)).decode("ascii")


def signature(timestamp: str, nonce: str, encrypt_key: str, body: bytes) -> str:
    return hashlib.sha256((timestamp + nonce + encrypt_key).encode("utf-8") + body).hexdigest()


@dataclass
class Sent:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


@dataclass
class WebhookSender:
    url: str
    verification_token: str
    app_id: str
    encrypt_key: str = ""

    def request(self, payload: dict[str, Any], *, encrypt_with: str | None = None, sign: bool = True,
                bad_signature: bool = False, undecryptable: bool = False,
                timestamp: str | None = None) -> tuple[bytes, dict[str, str]]:
        """The raw body and headers Feishu would send for ``payload`` (see the module docstring)."""
        key = self.encrypt_key if encrypt_with is None else encrypt_with
        plain = json.dumps(payload, ensure_ascii=False)
        if undecryptable:
            body = json.dumps({"encrypt": base64.b64encode(os.urandom(40)).decode()}).encode()
        elif key:
            body = json.dumps({"encrypt": encrypt(plain, key)}).encode()
        else:
            body = plain.encode("utf-8")
        headers = {"Content-Type": "application/json; charset=utf-8"}
        if sign and self.encrypt_key:
            ts = timestamp or str(int(time.time()))
            nonce = secrets.token_hex(8)
            sig = signature(ts, nonce, self.encrypt_key, body)
            if bad_signature:
                sig = hashlib.sha256(sig.encode()).hexdigest()
            headers.update({TIMESTAMP: ts, NONCE: nonce, SIGNATURE: sig})
        return body, headers

    async def send(self, payload: dict[str, Any], **options: Any) -> Sent:
        body, headers = self.request(payload, **options)
        async with aiohttp.ClientSession() as session, session.post(self.url, data=body, headers=headers) as resp:
            return Sent(resp.status, await resp.text())

    # ---- what Feishu sends -------------------------------------------------------------------------

    def message(self, text: str | None = None, *, token: str | None = None, **kw: Any) -> dict[str, Any]:
        return events.message_event(text, token=token or self.verification_token, app_id=self.app_id, **kw)

    def card_action(self, value: Any, *, token: str | None = None, **kw: Any) -> dict[str, Any]:
        return events.card_action_event(value, token=token or self.verification_token, app_id=self.app_id, **kw)

    def url_verification(self, *, token: str | None = None, challenge: str | None = None) -> dict[str, Any]:
        return events.url_verification(token=token or self.verification_token, challenge=challenge)
