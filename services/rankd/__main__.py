"""``python -m services.rankd``: run one rank daemon, as ``python -m services.rankd.main`` does
(see services/rankd/main.py)."""

from services.rankd.main import main

main()
