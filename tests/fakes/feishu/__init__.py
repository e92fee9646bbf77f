"""Protocol-level fakes of Feishu/Lark for tests driven by the real lark-oapi SDK: the Open API
(``FakeFeishu``), the webhook sender (``WebhookSender``), the long connection (``FakeLongConnection``) and a
driver that runs ``lark.ws.Client`` on a thread of its own (``WsClientThread``)."""

from tests.fakes.feishu.longconn import Ack, FakeLongConnection
from tests.fakes.feishu.openapi import ApiError, Call, Card, Chat, FakeFeishu, Fault, Message
from tests.fakes.feishu.webhook import WebhookSender
from tests.fakes.feishu.wsclient import WsClientThread

__all__ = ["Ack", "ApiError", "Call", "Card", "Chat", "FakeFeishu", "FakeLongConnection", "Fault", "Message",
           "WebhookSender", "WsClientThread"]
