"""`batchspec draft-vocab`: count a job's text and give a draft the vocabulary it scores
(batchspec.spec.draft_vocab)."""
from __future__ import annotations

import os
from collections.abc import Iterator

import click

from batchspec.spec import draft_vocab

TEXT_COLUMNS = ("prompt", "messages", "text")   # inputs, and the outputs of earlier runs


def texts_of(inputs: list[str], limit: int) -> Iterator[str]:
    """Up to `limit` texts from what a job reads (Parquet files, directories, globs, URLs,
    OpenAI Batch files: jobs/shards.py's expand_inputs) and its outputs: the prompt, text
    and chat messages' contents, row group by row group (a damaged one is skipped, and
    said so); any other file is one text."""
    import fsspec

    from batchspec.jobs import openai_batch
    from batchspec.jobs.shards import expand_inputs, iter_column
    try:
        files = expand_inputs(inputs)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    n = 0
    for path in files:
        fs, p = fsspec.core.url_to_fs(path)
        if fs.isdir(p):   # a folder a glob or folder matched, named like a file (x.parquet/)
            click.echo(f"{path}: a directory, skipped", err=True)
            continue
        if path.endswith(".parquet") or openai_batch.is_openai_batch(path):
            def skipped(group, e, path=path):
                click.echo(f"{path}: row group {group} skipped, unreadable ({e})", err=True)
            before = n
            try:
                values = (value for column in TEXT_COLUMNS
                          for _, value in iter_column(path, column, skipped))
                for value in values:
                    found = [m.get("content") for m in value if isinstance(m, dict)] \
                        if isinstance(value, list) else [value]
                    for text in found:
                        if isinstance(text, str) and text:
                            yield text
                            n += 1
                            if n >= limit:
                                return
            except ValueError as e:   # not a readable Parquet file (shards._open_parquet)
                raise click.ClickException(str(e)) from None
            if n == before:
                click.echo(f"{path}: no prompt, messages or text to count", err=True)
        else:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    yield fh.read()
            except OSError as e:
                raise click.ClickException(f"{path}: {e.strerror}") from None
            n += 1
            if n >= limit:
                return


@click.command("draft-vocab")
@click.argument("draft", type=click.Path(exists=True, file_okay=False))
@click.option("--data", "paths", multiple=True,
              help="Text to count, repeatable: what a job reads (Parquet files, directories, "
              "globs, URLs, OpenAI Batch files; their prompt and messages columns), a run's "
              "outputs (their text column), or text files.")
@click.option("--size", type=click.IntRange(min=1), help="Tokens to keep (the most frequent; "
              "default: a quarter of the vocabulary, at least 1,024).")
@click.option("--coverage", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Instead of --size: the fewest tokens that make up this share of the "
              "counted text.")
@click.option("--max-texts", type=click.IntRange(min=1), default=200_000, show_default=True,
              help="Count at most this many texts.")
@click.option("--remove", is_flag=True, help="Delete the draft's vocabulary: score every token.")
def draft_vocab_cmd(draft, paths, size, coverage, max_texts, remove):
    """Write DRAFT/draft_vocab.json: the tokens the draft's output layer scores (the most
    frequent in --data, and the end of sequence tokens). Outputs do not change: a draft
    only loses the rounds where the target picks a token it cannot propose."""
    from batchspec.models.loader import load_tokenizer, read_config
    if remove:
        if os.path.isfile(draft_vocab.path_of(draft)):
            os.remove(draft_vocab.path_of(draft))
        click.echo(f"{draft}: scores every token")
        return
    if not paths:
        raise click.UsageError("give the text to count with --data (or --remove)")
    if size is not None and coverage is not None:
        raise click.UsageError("give --size or --coverage, not both")
    try:
        cfg = read_config(draft)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise click.ClickException(f"{draft}: not a model directory ({e})") from None
    tok = load_tokenizer(draft)
    if tok is None:
        raise click.ClickException(f"{draft}: no tokenizer files to count text with")
    V = cfg.vocab_size
    if coverage is None and size is None:
        size = min(V, max(1024, V // 4))
    counts = draft_vocab.count_tokens(tok, texts_of(list(paths), max_texts))
    eos = set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    try:
        ids, covered = draft_vocab.choose(counts, V, size=size, coverage=coverage or 1.0,
                                          always=eos)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    try:
        where = draft_vocab.write(draft, ids, {
            "counted_tokens": sum(counts.values()), "covered": round(covered, 4),
            "data": list(paths)})
    except OSError as e:
        raise click.ClickException(f"cannot write {draft_vocab.path_of(draft)}: "
                                   f"{e.strerror or e}") from None
    click.echo(f"wrote {where}: {len(ids)} of {V} tokens, {covered:.1%} of the "
               f"{sum(counts.values()):,} counted")


COMMANDS = [draft_vocab_cmd]
