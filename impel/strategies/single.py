"""One process, one device: the base contract as is."""
from __future__ import annotations

from impel.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "NO"
