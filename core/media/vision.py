"""Whether images go to the model as images: ``[llm] vision = "auto" | true | false``.

``true`` and ``false`` are the operator's word. ``auto`` follows what is known of the configured model (the
local provider and text-only model families have no vision; today's GPT-4o/4.1/5, o-series, Claude 3+,
Gemini and the open vision models have it) and tries images with a model it does not know. A model that
refuses a request carrying images gets the same request again with images described in words
(``core.agent.loop``); that refusal describes those images for that request only. Under ``auto`` the model is
remembered as one without vision, for this process, so later turns describe images from the start, only when
the refusal says the model takes no images at all (:func:`says_no_vision`), or when a model of unknown
capability refused images in ``REFUSING_SESSIONS`` different conversations: one user's unreadable image is
refused for that user's request, never turns images off for everyone.
"""

from __future__ import annotations

import logging
import re
from typing import Literal

log = logging.getLogger(__name__)

VisionMode = Literal["auto"] | bool

# Families known to take image input (matched at the start of the model's name, after any "vendor/" prefix).
_VISION = re.compile(
    r"(gpt-4o|chatgpt-4o|gpt-4\.1|gpt-4\.5|gpt-4-turbo|gpt-4-vision|gpt-5|o1(?!-mini)|o3(?!-mini)|o4"
    r"|claude-(3|sonnet|opus|haiku|[a-z]+-4)|gemini|gemma-?3(?!.*:1b)|llava|bakllava|pixtral|qwen[0-9.]*-?vl|qvq"
    r"|llama-?3\.2.*vision|llama-?4|minicpm-v|moondream|internvl|glm-4v|grok-[0-9.]*-vision|mistral-small-3\.[12])",
    re.IGNORECASE)
# Families known to be text only.
_TEXT_ONLY = re.compile(r"(gpt-3\.5|gpt-4(-\d{4})?$|gpt-4-32k|o1-mini|o3-mini|claude-2|claude-instant|text-"
                        r"|deepseek|smollm)", re.IGNORECASE)
# What OpenAI-compatible servers answer when the model takes no image input at all (not: this image is bad).
# OpenAI: "Invalid content type. image_url is only supported by certain models."; Ollama: "this model does not
# support image input"; LM Studio: "Model does not support images"; llama.cpp: "image input is not supported";
# vLLM: "... is not a multimodal model", "At most 0 image(s) may be provided in one request."; DeepSeek:
# "unknown variant `image_url`, expected `text`". OpenAI's "You uploaded an unsupported image" (one bad image)
# is not among them.
_NO_VISION = re.compile(
    r"image_url is only supported by certain models|(does not|doesn't|do not|don't|cannot|can't) (support|accept)"
    r" (image|vision)|(image|vision)( input)?s? (is|are) not supported|not a multimodal model|at most 0 image"
    r"|unknown variant .?image_url", re.IGNORECASE)
REFUSING_SESSIONS = 3
"""Conversations whose requests with images a model of unknown capability refused before ``auto`` stops
sending it images (an answer that says it takes no images stops it at once)."""


def says_no_vision(error_text: str) -> bool:
    """Whether a model's error says it takes no image input at all (rather than refusing one image)."""
    return _NO_VISION.search(error_text) is not None


def known_vision(provider: str, model: str) -> bool | None:
    """True or False when the model's capability is known, None when it is not."""
    if provider == "local":
        return False  # llama.cpp text models (the bundled SmolLM2 among them)
    name = model.strip().rsplit("/", 1)[-1]
    if _TEXT_ONLY.match(name):
        return False
    if _VISION.match(name):
        return True
    return None


class VisionPolicy:
    def __init__(self, mode: VisionMode = "auto", provider: str = "", model: str = "") -> None:
        self.mode = mode
        self.model = model
        self._known = known_vision(provider, model)
        self._rejected = False
        self._refused_in: set[str] = set()

    def enabled(self) -> bool:
        """Whether a request may carry images now."""
        if self.mode is not True and self.mode is not False:  # "auto"
            return self._known is not False and not self._rejected
        return self.mode

    def rejected(self, session: str = "", *, unsupported: bool = False) -> None:
        """The model refused a request with images in ``session`` and took it with them described instead.
        ``unsupported``: its error said it takes no images at all (:func:`says_no_vision`). Under ``auto``, images
        stop for the whole process on such an answer, or when a model of unknown capability refused them in
        ``REFUSING_SESSIONS`` different sessions; any other refusal stays with the request it was made to."""
        if self.mode != "auto" or self._rejected:
            return
        if not unsupported:
            if self._known is not None:
                return  # a model known to take images refused one image (unreadable, too large): not vision
            self._refused_in.add(session)
            if len(self._refused_in) < REFUSING_SESSIONS:
                log.info("model %s refused a request with images in %s (%d of %d conversations before images are "
                         "described to it for everyone)", self.model or "(unnamed)", session,
                         len(self._refused_in), REFUSING_SESSIONS)
                return
        self._rejected = True
        log.warning("model %s rejected %s; describing images to it from now on ([llm] vision = true to keep "
                    "trying)", self.model or "(unnamed)", "image input" if unsupported else
                    f"requests with images in {len(self._refused_in)} conversations")
