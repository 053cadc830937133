"""Maps the top-level folders onto the ``loraplex`` namespace.

``engine/`` installs as ``loraplex.engine``, ``resolvers/`` as ``loraplex.resolvers`` and
``plugins/`` as ``loraplex.plugins``; sub-packages follow automatically.

The demo model's folders (``engine/demo/assets`` and its adapter folders) hold data, no
Python. They are listed as packages of their own (setuptools' "data files as packages") with
their files as that package's data: a folder the build finds importable but that is not in
``packages`` makes setuptools warn that it would be ignored, one warning per folder.
"""

from setuptools import find_namespace_packages, find_packages, setup

TOP = ("engine", "resolvers", "plugins")
ASSETS = "loraplex.engine.demo.assets"

packages: list[str] = []
package_dir: dict[str, str] = {}
for top in TOP:
    package_dir[f"loraplex.{top}"] = top
    packages.append(f"loraplex.{top}")
    packages += [f"loraplex.{top}.{sub}" for sub in find_packages(top)]

assets = [ASSETS] + [f"{ASSETS}.{sub}" for sub in find_namespace_packages("engine/demo/assets")]
packages += assets

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={name: ["*.json", "*.safetensors"] for name in assets},
)
