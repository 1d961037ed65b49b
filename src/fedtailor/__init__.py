"""fedtailor: private and personalized federated learning.

Shared parts live once (``data``, ``models``, ``privacy``, ``codecs``, ``fl``); each method is one module in
``methods``. See the README for the quick start.
"""

__version__ = "0.1.0"
