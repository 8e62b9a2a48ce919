import sys

from megatron_lora_patch.cli import main

sys.exit(main())
