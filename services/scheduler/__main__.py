"""``python -m services.scheduler``: run one scheduler replica (see services/scheduler/main.py)."""

from services.scheduler.main import main

main()
