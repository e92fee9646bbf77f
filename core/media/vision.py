"""Whether images go to the model as images: ``[llm] vision = "auto" | true | false``.

``true`` and ``false`` are the operator's word. ``auto`` follows what is known of the configured model (the
local provider and text-only model families have no vision; today's GPT-4o/4.1/5, o-series, Claude 3+,
Gemini and the open vision models have it) and tries images with a model it does not know. A model that
rejects a request carrying images gets the same request once more with each image described in words
(``core.agent.loop``); under ``auto`` the model is then remembered as one without vision, for this process,
so later turns describe images from the start.
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

    def enabled(self) -> bool:
        """Whether a request may carry images now."""
        if self.mode is not True and self.mode is not False:  # "auto"
            return self._known is not False and not self._rejected
        return self.mode

    def rejected(self) -> None:
        """The model refused a request with images and took it with descriptions instead."""
        if self.mode == "auto" and not self._rejected:
            self._rejected = True
            log.warning("model %s rejected a request with images; describing images to it from now on "
                        "([llm] vision = true to keep trying)", self.model or "(unnamed)")
