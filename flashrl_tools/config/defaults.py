"""What each `fn` means when nothing else is given: the `bf16` / `fp8` / `int8` shortcuts of
FLASHRL_CONFIG and the entries `flashrl setup` starts from."""

from __future__ import annotations

_LOGPROBS = {"logprobs_mode": "processed_logprobs"}  # TIS needs the distribution actually sampled
DEFAULTS: dict[str, dict] = {
    "bf16": {"fn": "bf16", **_LOGPROBS},
    "fp8": {"fn": "fp8", "quantization": "fp8", "module_attribute_to_preserve": ["workspace"], **_LOGPROBS},
    "int8": {"fn": "int8", **_LOGPROBS},
    "fp8_channel": {"fn": "fp8_channel", "module_attribute_to_preserve": ["workspace"], **_LOGPROBS},
    "fp8_tensor": {"fn": "fp8_tensor", "module_attribute_to_preserve": ["workspace"], **_LOGPROBS},
    "fp8_block": {"fn": "fp8_block", "module_attribute_to_preserve": ["workspace"], **_LOGPROBS},
    "w4a16": {"fn": "w4a16", **_LOGPROBS},
}
