"""What both the CLI and the runtime read, with no engine import: the rollout-config YAML schema
(`schema`) and the shortcuts' defaults (`defaults`), FLASHRL_CONFIG resolution (`resolve`), Hub
references and their errors (`hubref`, `hub_errors`, `hub`), and the FLASHRL_* settings
(`settings`)."""
