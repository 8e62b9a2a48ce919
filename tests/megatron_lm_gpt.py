"""A GPT launch script in the shape of Megatron-LM's `pretrain_gpt.py`, for `torchrun`: its body is
`megatron_lm_gpt_steps.py` (providers, `forward_step`, `loss_func`, `main`).

The body is imported only when this file runs as the script. Megatron's torch_dist save starts a results-queue
manager with multiprocessing's spawn, which re-imports the launch script as `__mp_main__`: a script that imports
torch and Megatron at its top costs every saving rank one more such import (about 8 s here) per run.
"""

if __name__ == "__main__":
    from megatron_lm_gpt_steps import main

    main()
