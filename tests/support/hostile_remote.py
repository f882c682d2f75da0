"""The hostile S3 server (tests/support/hostile_s3.py) on 127.0.0.1 as the tests drive it: started in a
process of its own, told how to misbehave (behaviours.json), its objects read and written behind
gpusnap's back; and the credentials it takes. Shared by the hostile-remote and switch tests."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from conftest import REPO

CREDS = {"GPUSNAP_S3_ACCESS_KEY_ID": "any", "GPUSNAP_S3_SECRET_ACCESS_KEY": "any", "GPUSNAP_S3_MAX_ATTEMPTS": "1"}


class Hostile:
    kind = "s3"

    def __init__(self, tmp: Path) -> None:
        self.behaviours = tmp / "behaviours.json"
        self.set({})
        portfile = tmp / "port"
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "hostile_s3.py"),
                                      str(portfile), str(self.behaviours)])
        deadline = time.monotonic() + 20
        while not portfile.exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, "hostile S3 server did not start"
            time.sleep(0.05)
        self.endpoint = f"http://127.0.0.1:{portfile.read_text()}"
        self.remote_args = ["s3://bkt/p", "--endpoint", self.endpoint]

    def set(self, behaviours: Mapping[str, object]) -> None:
        self.behaviours.write_text(json.dumps(behaviours))

    def _s3(self) -> Any:
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="any",
                            aws_secret_access_key="any", config=Config(s3={"addressing_style": "path"}))

    def keys(self, prefix: str) -> list[str]:
        """The keys under PREFIX (relative to the remote's root), read behind gpusnap's back."""
        return [o["Key"][2:] for o in self._s3().list_objects_v2(Bucket="bkt", Prefix="p/" + prefix).get("Contents", [])]

    def read(self, key: str) -> bytes:
        return bytes(self._s3().get_object(Bucket="bkt", Key="p/" + key)["Body"].read())

    def write(self, key: str, data: bytes) -> None:
        self._s3().put_object(Bucket="bkt", Key="p/" + key, Body=data)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
