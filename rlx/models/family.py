"""`family_of(config)`: the one question callers ask about a model config, answered with its family's bundle.

Callers outside rlx.models never test what kind of model they hold; they call the bundle's methods (see
`rlx.models.bundle.ModelFamily`). A vision-language config gets its `VisionFamily` (or a UserError naming a
family rlx cannot train), a mixture-of-experts config its `MoeFamily`, any other config the text family.
"""

from __future__ import annotations

from rlx.models.bundle import TEXT_FAMILY, ModelFamily
from rlx.models.moe import MOE_FAMILIES
from rlx.models.vision.families import FAMILIES, KNOWN_UNSUPPORTED, is_vision_config, vision_family_of


def family_of(config) -> ModelFamily:
    """The bundle of `config`'s family: its VisionFamily for a vision-language model, its MoeFamily for a
    mixture-of-experts one, else the text family."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES or model_type in KNOWN_UNSUPPORTED or is_vision_config(config):
        return vision_family_of(config)
    return MOE_FAMILIES.get(model_type, TEXT_FAMILY)
