from deepspeed_loco.perf.cli import main

main()
