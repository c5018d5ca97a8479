# templates/ and csrc/ live at the top of the tree (the design's layout) and
# ship inside the installed package as flashgen/_data/{templates,csrc};
# flashgen.resources finds them in either place.
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["flashgen", "flashgen.*"])
    + ["flashgen._data.templates", "flashgen._data.csrc"],
    package_dir={"flashgen._data.templates": "templates", "flashgen._data.csrc": "csrc"},
    package_data={
        "flashgen._data.templates": ["**/*.j2"],
        "flashgen._data.csrc": ["**/*.h", "**/*.cuh", "**/*.cc"],
    },
)
