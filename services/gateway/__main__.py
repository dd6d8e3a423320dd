"""``python -m services.gateway``: run one gateway (see services/gateway/main.py)."""

from services.gateway.main import main

main()
