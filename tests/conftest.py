import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray 2.60 default: keep token auth on in tests
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the CPU step channel stays on loopback
