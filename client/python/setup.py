"""Builds attention_client with its protobuf and gRPC stubs.

The stubs are generated from the repository's proto/ (or $ATTENTION_PROTO_DIR)
by protoc and grpc_python_plugin when the package is built, into
attention_client/_proto/ of the build, never into the source tree. protoc's
Python output imports its siblings as top-level "attention.v1"; those imports
are rewritten to the package's own path, so nothing named "attention" is
installed beside it.
"""
import glob
import os
import re
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.environ.get("ATTENTION_PROTO_DIR", os.path.join(HERE, "..", "..", "proto"))
PACKAGE_PROTO = "attention_client._proto"


def _tool(env, name):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} not found (set ${env}); Debian 12: apt-get install "
                           "protobuf-compiler protobuf-compiler-grpc")
    return path


def generate_stubs(out_dir):
    """Writes the attention.v1 stubs into out_dir as the package attention_client._proto."""
    protos = sorted(glob.glob(os.path.join(PROTO_DIR, "attention", "v1", "*.proto")))
    if not protos:
        raise RuntimeError(f"no attention/v1/*.proto under {PROTO_DIR} (set $ATTENTION_PROTO_DIR)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([
            _tool("PROTOC", "protoc"), f"-I{PROTO_DIR}", f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--plugin=protoc-gen-grpc_python={_tool('GRPC_PYTHON_PLUGIN', 'grpc_python_plugin')}",
            *[os.path.relpath(p, PROTO_DIR) for p in protos]
        ], cwd=PROTO_DIR, check=True)
        target = os.path.join(out_dir, "attention", "v1")
        os.makedirs(target, exist_ok=True)
        for folder in (out_dir, os.path.dirname(target), target):
            open(os.path.join(folder, "__init__.py"), "w").close()
        for path in glob.glob(os.path.join(tmp, "attention", "v1", "*.py")):
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^from attention\.v1 import", f"from {PACKAGE_PROTO}.attention.v1 import",
                          text, flags=re.M)
            with open(os.path.join(target, os.path.basename(path)), "w") as f:
                f.write(text)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(os.path.join(self.build_lib, *PACKAGE_PROTO.split(".")))


setup(cmdclass={"build_py": BuildPyWithStubs})
