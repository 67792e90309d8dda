"""Small-scale reproduction of the paper's main comparison (issue 7).

    .venv/bin/python -m bench.repro.run --config configs/repro/smollm2.yaml --budget-minutes 140

config.py   the experiment definition (configs/repro/*.yaml)
workload.py the model, data subsets, atlas and scorers the runner works on
runner.py   sweeps, training runs, a unit per scored checkpoint; resume and time budget
scoring.py  one checkpoint's scores (MBPP+, held-out NLL, retained KL, GSM8K answers) and their clocks
store.py    the per-unit results files (results/repro/<name>/), fingerprinted per method
migrate.py  the one-off migration of results with the old whole-config fingerprint (issue 16)
report.py   tables and plots from the results files only
"""
