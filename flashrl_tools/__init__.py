"""flashrl_tools: 8-bit rollouts in vLLM for RL training, with BF16 learning."""

__version__ = "0.1.0"
