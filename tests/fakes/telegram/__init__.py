from tests.fakes.telegram.server import Call, FakeTelegram, Fault, Shown

__all__ = ["Call", "FakeTelegram", "Fault", "Shown"]
