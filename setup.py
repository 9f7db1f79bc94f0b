"""Maps the repository's folders (one room per job) onto one import namespace, `specserve.*`.

pyproject.toml holds the metadata; this file only says which folder is which subpackage. A room
whose folder is absent is left out, which is how the serving images (deploy/Dockerfile*) install
specserve without the training and benchmark rooms: they copy only the serving folders.
Nothing generic (`proto`, `cluster`, ...) is installed at the top level of site-packages.
"""

import os

from setuptools import setup

ROOMS = {
    "specserve": "specserve",  # config, builder, CLI
    "specserve.core": "core",  # shared by both processes
    "specserve.proto": "proto",  # the wire contract
    "specserve.drafter": "drafter_service",
    "specserve.verifier": "verifier_service",
    "specserve.cluster": "cluster",  # Ray wiring, Serve app, HTTP protocol
    "specserve.training": "training",
    "specserve.benchmarks": "benchmarks",
}
HERE = os.path.dirname(os.path.abspath(__file__))
present = {pkg: folder for pkg, folder in ROOMS.items() if os.path.isfile(os.path.join(HERE, folder, "__init__.py"))}

setup(packages=list(present), package_dir=present, package_data={"specserve.proto": ["*.proto"]})
