"""``python -m benchmarks.emulated --nodes 2 --per-node 2 --rate 200mbit -- python train.py ...``"""

from benchmarks.emulated.launch import main

raise SystemExit(main())
