"""The HTTP layer: one package per role (``settings.py``, ``schemas.py``, ``app.py``), the template
they share (`services.template`), the role table (`services.roles`) and the roles' Serve applications on Ray
(`services.cluster`). The ``weir`` command that starts them is the launcher's (`launcher`), which this
package never imports."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("weir")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
