"""``python -m services.cachemgr``: run the cache manager (see services/cachemgr/main.py)."""

from services.cachemgr.main import main

main()
