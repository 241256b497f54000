"""The C++ library builds from copies of its sources in the build folder, so that two checkouts at different paths
write the same build.ninja and the second one loads the first one's library instead of recompiling it."""
import os

from kernels import cpu_native


def test_the_build_reads_copies_in_its_folder_and_leaves_unchanged_ones_alone(tmp_path):
    sources, include = cpu_native.sources_in(str(tmp_path))
    assert include == str(tmp_path / "src")
    assert [os.path.basename(p) for p in sources] == [os.path.basename(p) for p in cpu_native.SOURCES]
    for original in cpu_native.SOURCES + cpu_native.HEADERS:
        copy = tmp_path / "src" / os.path.basename(original)
        assert copy.read_bytes() == open(original, "rb").read()
    first = tmp_path / "src" / "cpu_native.cpp"
    os.utime(first, (1_000_000, 1_000_000))
    stale = tmp_path / "src" / "cpu_kernels.h"
    stale.write_text("// an older header\n")
    assert cpu_native.sources_in(str(tmp_path)) == (sources, include)
    assert first.stat().st_mtime == 1_000_000  # same bytes: not rewritten, so ninja sees nothing new
    assert stale.read_bytes() == open(cpu_native.HEADERS[0], "rb").read()  # other bytes: replaced
    assert not [p for p in os.listdir(tmp_path / "src") if p.endswith(".tmp")]


def test_without_a_folder_of_our_own_the_sources_are_used_where_they_are():
    assert cpu_native.sources_in(None) == (cpu_native.SOURCES, os.path.dirname(cpu_native.SOURCES[0]))
