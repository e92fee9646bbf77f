"""Typed turn failures and the one place that turns them into words a chat user may see."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from core.llm.provider import ProviderError, ProviderErrorKind


class TurnFailureKind(Enum):
    INPUT_PERSISTENCE = "input_persistence"
    AGENT_CREATION = "agent_creation"
    CONTEXT_PREPARATION = "context_preparation"
    PROVIDER = "provider"
    TURN_PERSISTENCE = "turn_persistence"
    DELIVERY = "delivery"


@dataclass(frozen=True, slots=True)
class TurnFailure:
    kind: TurnFailureKind
    detail: str = ""
    """For logs only (already free of secrets); never shown in a chat."""
    provider_kind: ProviderErrorKind | None = None
    retry_after: float | None = None
    """Seconds the provider asked the bridge to wait (a rate limit's ``retry-after``), when it said."""


def provider_failure(error: ProviderError) -> TurnFailure:
    """The failure of a turn whose model request failed with ``error`` (its ``str`` is free of secrets)."""
    return TurnFailure(TurnFailureKind.PROVIDER, str(error), error.kind, error.retry_after)


_PROVIDER_TEXT: dict[ProviderErrorKind, str] = {
    ProviderErrorKind.AUTH: "The model provider rejected the bridge's credentials. The operator needs to check "
    "the API key in the bridge configuration.",
    ProviderErrorKind.TIMEOUT: "The model did not answer in time, even after several retries. Please try again "
    "in a moment.",
    ProviderErrorKind.TRANSIENT: "The model provider is unavailable right now, even after several retries. "
    "Please try again in a moment.",
    ProviderErrorKind.RATE_LIMIT: "The model provider is rate-limiting the bridge. Please try again in a minute.",
    ProviderErrorKind.QUOTA: "The model provider says the bridge's account has run out of quota (its credit or "
    "budget is used up), so no answer can be written until the operator tops it up or raises the limit.",
    ProviderErrorKind.MALFORMED: "The model sent an answer the bridge could not read, even after several "
    "retries. Please try again.",
    ProviderErrorKind.CONTEXT_OVERFLOW: "This conversation no longer fits the model's context. Send /new to "
    "start a fresh one.",
    ProviderErrorKind.BAD_REQUEST: "The model provider refused the request. The operator can find details in "
    "the bridge log.",
    ProviderErrorKind.UNAVAILABLE: "The configured model cannot run on this bridge. The operator can find "
    "details in the bridge log.",
}

_KIND_TEXT: dict[TurnFailureKind, str] = {
    TurnFailureKind.INPUT_PERSISTENCE: "Your message could not be saved, so it was not answered. Please send it "
    "again.",
    TurnFailureKind.AGENT_CREATION: "The assistant could not be started. The operator can find details in the "
    "bridge log.",
    TurnFailureKind.CONTEXT_PREPARATION: "The conversation history could not be loaded, so your message was not "
    "answered. Please try again.",
    TurnFailureKind.PROVIDER: "The model failed to answer. Please try again.",
    TurnFailureKind.TURN_PERSISTENCE: "The answer could not be saved, so it is not shown as complete. Please "
    "send your message again.",
    TurnFailureKind.DELIVERY: "The answer could not be delivered.",
}


class TurnFailurePresenter:
    """Maps failures and notices to user-visible text. Channels may subclass it for their own tone."""

    def failure(self, failure: TurnFailure) -> str:
        if failure.kind is TurnFailureKind.PROVIDER and failure.provider_kind is not None:
            if failure.provider_kind is ProviderErrorKind.RATE_LIMIT and failure.retry_after is not None \
                    and failure.retry_after > 60:
                # "in a minute" is only true of a wait up to a minute; a longer one (which the ladder does not
                # wait out, ``core.llm.retry``) is named roughly, or the user comes back too soon, again and again
                return ("⚠️ The model provider is rate-limiting the bridge and asked it to wait "
                        f"{_age(failure.retry_after)}. Please try again after that.")
            return "⚠️ " + _PROVIDER_TEXT[failure.provider_kind]
        return "⚠️ " + _KIND_TEXT[failure.kind]

    def failed_with_partial(self, failure: TurnFailure, partial: str) -> str:
        return f"{partial}\n\n{self.failure(failure)}"

    def cancelled(self, partial: str, *, by_shutdown: bool = False) -> str:
        """A stopped turn's end: by a user's /stop, or by the bridge shutting down (then it says so, and that
        the message is not answered by itself later)."""
        stopped = "⏹ Stopped: the bridge is shutting down. Send your message again once it is back." \
            if by_shutdown else "⏹ Stopped."
        return f"{partial}\n\n{stopped}" if partial else stopped

    def empty_answer(self) -> str:
        return "⚠️ The model finished without writing an answer. Please try again or rephrase your message."

    def busy(self, capacity: int) -> str:
        return (f"⏳ I'm still working on your earlier messages ({capacity} are waiting). This one was not "
                "queued; please send it again in a moment.")

    def interrupted_by_restart(self) -> str:
        return "⚠️ The bridge restarted while answering your last message. Please send it again."

    def nothing_to_stop(self) -> str:
        return "Nothing is running."

    def new_context(self, unanswered: int = 0) -> str:
        text = "🆕 Started a new conversation. Earlier messages stay in the history but are no longer sent to " \
               "the model."
        if unanswered:
            text += (" The message you sent before /new was not answered." if unanswered == 1 else
                     f" The {unanswered} messages you sent before /new were not answered.")
        return text

    def too_old_after_restart(self, age_seconds: float) -> str:
        return (f"⚠️ The bridge stopped before it could answer this message, which is now {_age(age_seconds)} "
                "old: too old to answer. Please send it again if it still matters.")

    def help(self, commands: dict[str, str]) -> str:
        lines = ["Commands:"] + [f"/{name} — {text}" for name, text in commands.items()]
        return "\n".join(lines)


def _age(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 120:
        return f"{max(minutes, 1)} minute{'s' if minutes != 1 else ''}"
    hours = round(seconds / 3600)
    if hours < 48:
        return f"{hours} hours"
    return f"{round(seconds / 86400)} days"
