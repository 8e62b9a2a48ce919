"""Exchange with Hugging Face PEFT: the logical adapter to and from PEFT's names and layouts (dense
and expert), and the transfer between a checkpoint or live model and a PEFT directory."""
