"""Maps the top-level folders onto the ``loraplex`` namespace.

``engine/`` installs as ``loraplex.engine``, ``resolvers/`` as ``loraplex.resolvers`` and
``plugins/`` as ``loraplex.plugins``; sub-packages follow automatically.
"""

from setuptools import find_packages, setup

TOP = ("engine", "resolvers", "plugins")

packages: list[str] = []
package_dir: dict[str, str] = {}
for top in TOP:
    package_dir[f"loraplex.{top}"] = top
    packages.append(f"loraplex.{top}")
    packages += [f"loraplex.{top}.{sub}" for sub in find_packages(top)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"loraplex.engine": ["demo/assets/**/*"]},
)
