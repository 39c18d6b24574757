from rewardbox.wire import protogen


def test_committed_stubs_match_the_proto_file():
    generated = protogen.generate()
    for name, text in generated.items():
        committed = (protogen.OUT_DIR / name).read_text()
        assert committed == text, (
            f"proto/pb/{name} is stale: run `python -m rewardbox.wire.protogen` and commit the result"
        )
