"""PEP 517 backend: setuptools, plus the start-up ``.pth`` file at the root of devshim-core's wheels.

setuptools cannot place a file at the top of site-packages, and its editable wheels carry only its
own path hooks. ``DEVSHIM_AUTO=1`` must work in processes that never run the user's import line
(the ``deepspeed`` launcher, spawned workers), so both the regular and the editable wheel get the file.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (re-export the rest of the PEP 517 interface)

PTH_NAME = "devshim-auto.pth"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def _add_pth(wheel_path: str) -> None:
    with open(os.path.join(_HERE, PTH_NAME), "rb") as f:
        payload = f.read()
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(wheel_path))
    os.close(fd)
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                text = data.decode()
                if not text.endswith("\n"):
                    text += "\n"
                data = (text + _record_line(PTH_NAME, payload)).encode()
            dst.writestr(item, data)
        dst.writestr(PTH_NAME, payload)
    os.chmod(tmp, os.stat(wheel_path).st_mode & 0o777)  # mkstemp made it 0600; keep the wheel's own mode
    shutil.move(tmp, wheel_path)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name
