"""Imports every loader module so that each registers itself in base.REGISTRY."""

from . import synthetic  # noqa: F401
from . import stackoverflow  # noqa: F401
from . import cc_news  # noqa: F401
from . import local  # noqa: F401
from . import fortunes  # noqa: F401
