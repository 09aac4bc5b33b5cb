"""--metrics-listen values: HOST:PORT or off; the worker's default is the next port."""
import pytest

from engine_common.configuration.listen_address import ListenAddress, next_port, split_listen
from engine_common.request.params import ParamError


@pytest.mark.parametrize("value", ["127.0.0.1:9400", "0.0.0.0:0", "[::1]:65535", "host:1",
                                   "off"])
def test_accepted(value):
    ListenAddress().check("metrics_listen", value)


@pytest.mark.parametrize("value", ["9400", ":9400", "host:", "host:65536", "host:-1", "on", ""])
def test_rejected_with_the_field_value_and_range(value):
    with pytest.raises(ParamError, match=r"metrics_listen.*HOST:PORT \(port in \[0, 65535\]\) "
                                         r"or off"):
        ListenAddress().check("metrics_listen", value)


def test_next_port_keeps_the_host_and_zero_and_off():
    assert next_port("127.0.0.1:9400") == "127.0.0.1:9401"
    assert next_port("[::1]:80") == "[::1]:81"
    assert next_port("0.0.0.0:0") == "0.0.0.0:0"
    assert next_port("off") == "off"
    assert split_listen("[::1]:80") == ("::1", 80)
