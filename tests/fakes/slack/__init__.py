"""Protocol-level fakes of Slack: the Web API and Socket Mode (``FakeSlack``), and a signed HTTP event sender."""

from tests.fakes.slack.blocks import SlackError, block_text
from tests.fakes.slack.sender import EventSender, Sent, sign
from tests.fakes.slack.server import Call, Ephemeral, FakeSlack, Fault, Message, RateRule
from tests.fakes.slack.socket import Ack, Connection, Envelope, FakeSocketMode

__all__ = ["Ack", "Call", "Connection", "Envelope", "Ephemeral", "EventSender", "FakeSlack", "FakeSocketMode",
           "Fault", "Message", "RateRule", "Sent", "SlackError", "block_text", "sign"]
