"""``python -m services.controller``: run the controller (see services/controller/main.py)."""

from services.controller.main import main

main()
