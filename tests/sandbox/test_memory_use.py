"""memory_use's reads of kernel files: whole, whatever their size."""

from rewardbox.sandbox.memory import memory_use


def test_a_file_is_read_whole_below_at_and_past_the_first_reads_buffer(tmp_path):
    for size in (0, 1, memory_use._FIRST_READ_BYTES - 1, memory_use._FIRST_READ_BYTES,
                 memory_use._FIRST_READ_BYTES + 1, 3 * memory_use._MIB + 17):
        path = tmp_path / f"f{size}"
        data = bytes(i % 251 for i in range(size))
        path.write_bytes(data)
        assert memory_use._read(str(path)) == data


def test_a_kernel_table_reads_as_its_text():
    with open("/proc/self/mountinfo", "rb") as f:
        expected_lines = f.read().count(b"\n")
    assert memory_use._read("/proc/self/mountinfo").count(b"\n") == expected_lines
