"""worker_service/service/auth.py: where a worker without credentials may listen."""
from __future__ import annotations

import pytest

from engine_common.params import ParamError
from engine_common.worker_auth import WorkerAuth
from worker_service.service.auth import check_exposure, is_loopback


@pytest.mark.parametrize("listen,loopback", [
    ("127.0.0.1:50052", True), ("127.3.4.5:1", True), ("localhost:1", True), ("[::1]:1", True),
    ("0.0.0.0:50052", False), ("[::]:1", False), (":50052", False), ("10.0.0.1:1", False),
    ("worker-0.svc:1", False),
])
def test_loopback_addresses(listen, loopback):
    assert is_loopback(listen) is loopback


def test_no_credential_beyond_loopback_needs_insecure():
    with pytest.raises(ParamError, match=r"listen='0.0.0.0:50052' is invalid: must be a "
                                         r"loopback address .*--worker-token-file"):
        check_exposure("0.0.0.0:50052", WorkerAuth(), insecure=False)
    check_exposure("0.0.0.0:50052", WorkerAuth(), insecure=True)
    check_exposure("0.0.0.0:50052", WorkerAuth(token="t" * 16), insecure=False)
    check_exposure("127.0.0.1:50052", WorkerAuth(), insecure=False)
