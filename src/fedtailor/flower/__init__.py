"""Flower adapters: the same :class:`~fedtailor.fl.method.Method` halves run as a Flower ``ServerApp`` and
``ClientApp`` (Message API). The core never imports this package; it needs ``pip install -e .[flower]``."""
