"""Two gloo ranks: the first tokenises and caches while the other waits past the process group's timeout."""

import json
import os
import time
from datetime import timedelta

import pytest
import torch.multiprocessing as mp

ROWS = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(12)]


def _worker(rank, world, init_file, data_path, model_dir, cache_dir, out_dir):
    import torch.distributed as dist

    from shardtune.data import DataConfig, load_tokenizer, pipeline, prepare_datasets
    from shardtune.dist import shutdown

    os.environ["LOCAL_RANK"] = str(rank)
    # a 2 s collective timeout: waiting on the default group for a 4 s tokenisation would fail
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=2))
    slow_build = pipeline.build_split

    def build_slowly(*args, **kwargs):
        time.sleep(4)
        return slow_build(*args, **kwargs)

    pipeline.build_split = build_slowly
    result = {}
    for name, path in (("good", data_path), ("bad", data_path + ".bad.jsonl")):
        cfg = DataConfig(dataset_name=path, splits="train", max_seq_len=32)
        tok = load_tokenizer(model_dir, cfg)
        try:
            data = prepare_datasets(cfg, tok, seed=0, cache_dir=cache_dir)
            result[name] = {"from_cache": data.from_cache, "rows": data.train.to_list()}
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown()  # not destroy_process_group alone: see test_dist_shutdown (SIGABRT at exit)


@pytest.mark.timeout(180)
def test_rank0_builds_others_wait_and_load(tmp_path):
    from shardtune.testing.tiny import make_model_folder

    model_dir = str(make_model_folder(tmp_path / "model"))
    data_path = tmp_path / "d.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.jsonl.bad.jsonl").write_text('{"prompt": "x", "completion": "y"}\n{broken\n')
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(data_path), model_dir, str(tmp_path / "cache"),
                            str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["good"]["from_cache"] is False and r1["good"]["from_cache"] is True
    assert r0["good"]["rows"] == r1["good"]["rows"] and len(r0["good"]["rows"]) == len(ROWS)
    # the builder's error reaches every rank as the same one-line UsageError
    assert r0["bad"]["error"].startswith("UsageError:") and "d.jsonl.bad.jsonl:2: malformed JSON" in r0["bad"]["error"]
    assert r1["bad"]["error"] == r0["bad"]["error"]
