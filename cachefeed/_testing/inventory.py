"""Manifests for tests and benchmarks: S3 Inventory reports in the format AWS documents, and key lists.

An S3 Inventory report is a ``manifest.json`` in the destination bucket under
``<prefix>/<source bucket>/<config id>/<timestamp>/`` naming data files under ``<prefix>/.../data/``: CSV files
(gzipped, no header row, every field quoted, keys URL-encoded, columns in ``fileSchema`` order) or Parquet files
(snake-case columns, keys as they are). See "Configuring Amazon S3 Inventory" and "Locating your inventory list"
in the S3 user guide. These helpers write one from what the test put in the source bucket, through a boto3 client.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
from typing import Any
from urllib.parse import quote_plus

__all__ = ["CSV_SCHEMA", "write_inventory", "write_key_list"]

CSV_SCHEMA = "Bucket, Key, Size, LastModifiedDate, ETag, StorageClass, IsMultipartUploaded, IsLatest, IsDeleteMarker"


def _objects(client: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found += page.get("Contents", [])
    return found


def write_inventory(
    client: Any,
    *,
    source_bucket: str,
    destination_bucket: str,
    file_format: str = "CSV",
    files: int = 2,
    prefix: str = "",
    extra_rows: list[dict[str, Any]] | None = None,
) -> str:
    """Write an inventory report of ``source_bucket`` (objects under ``prefix``) into ``destination_bucket``;
    returns the manifest's key. ``extra_rows`` (e.g. a delete marker) are added to the last file."""
    objects = _objects(client, source_bucket, prefix)
    rows: list[dict[str, Any]] = [
        {
            "bucket": source_bucket,
            "key": obj["Key"],
            "size": int(obj["Size"]),
            "last_modified_date": obj["LastModified"],
            "e_tag": obj["ETag"].strip('"'),  # reports give the ETag without quotes
            "storage_class": "STANDARD",
            "is_multipart_uploaded": False,
            "is_latest": True,
            "is_delete_marker": False,
        }
        for obj in objects
    ] + list(extra_rows or [])
    base = f"inventory/{source_bucket}/daily/2026-11-25T01-00Z"
    entries = []
    per_file = max(1, -(-len(rows) // files))
    for index in range(files):
        chunk = rows[index * per_file : (index + 1) * per_file]
        if file_format == "CSV":
            key = f"inventory/{source_bucket}/daily/data/part-{index}.csv.gz"
            body = _csv_gz(chunk)
        else:
            key = f"inventory/{source_bucket}/daily/data/part-{index}.parquet"
            body = _parquet(chunk)
        client.put_object(Bucket=destination_bucket, Key=key, Body=body)
        entries.append({"key": key, "size": len(body), "MD5checksum": hashlib.md5(body).hexdigest()})  # noqa: S324
    manifest = {
        "sourceBucket": source_bucket,
        "destinationBucket": f"arn:aws:s3:::{destination_bucket}",
        "version": "2016-11-30",
        "creationTimestamp": "1764032400000",
        "fileFormat": file_format,
        "fileSchema": CSV_SCHEMA
        if file_format == "CSV"
        else "message s3.inventory { required binary bucket (STRING); required binary key (STRING); "
        "optional int64 size; optional int64 last_modified_date (TIMESTAMP(MILLIS,true)); "
        "optional binary e_tag (STRING); optional binary storage_class (STRING); "
        "optional boolean is_multipart_uploaded; optional boolean is_latest; optional boolean is_delete_marker; }",
        "files": entries,
    }
    manifest_key = f"{base}/manifest.json"
    client.put_object(Bucket=destination_bucket, Key=manifest_key, Body=json.dumps(manifest).encode())
    return manifest_key


def _csv_gz(rows: list[dict[str, Any]]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for row in rows:
        writer.writerow(
            [
                row["bucket"],
                quote_plus(row["key"], safe="/"),
                row["size"],
                row["last_modified_date"].strftime("%Y-%m-%dT%H:%M:%S.000Z"),
                row["e_tag"],
                row["storage_class"],
                str(row["is_multipart_uploaded"]).lower(),
                str(row["is_latest"]).lower(),
                str(row["is_delete_marker"]).lower(),
            ]
        )
    return gzip.compress(text.getvalue().encode())


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    table = pa.Table.from_pylist(rows)
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def write_key_list(
    client: Any, *, source_bucket: str, destination_bucket: str, key: str, prefix: str = "", sizes: bool = True
) -> str:
    """A gzipped key list of ``source_bucket``'s objects under ``prefix`` (``key<TAB>size<TAB>etag``, keys
    relative to ``prefix``) at ``key`` in ``destination_bucket``; returns ``key``."""
    lines = ["# written by cachefeed._testing.inventory"]
    for obj in _objects(client, source_bucket, prefix):
        relative = obj["Key"][len(prefix) :]
        lines.append(f"{relative}\t{obj['Size']}\t{obj['ETag']}" if sizes else relative)
    client.put_object(Bucket=destination_bucket, Key=key, Body=gzip.compress("\n".join(lines).encode()))
    return key
