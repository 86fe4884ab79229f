"""The mapper artifact format: its one owner (docs/artifact-format.md).

    metadata = read_artifact(directory)      # every check: mapper.json fields, tensor header, sha256, finiteness
    metadata = read_metadata(directory)      # mapper.json only
    write_artifact(directory, tensors, metadata)

Modules: ``metadata`` (mapper.json: format versions, fields, their types and ranges), ``tensors`` (names
and shapes of every map structure, the safetensors header, NaN/Inf scan), ``directory`` (reading,
writing, which files an artifact holds), ``files`` (atomic writes, copies that never follow symbolic
links).  Importing this package loads neither torch nor transformers.
"""

from kvhub.artifact.directory import (
    CARD_FILE,
    FIGURE_SUFFIXES,
    is_figure_name,
    parse_metadata_bytes,
    publishable_files,
    read_artifact,
    read_metadata,
    tensor_path,
    verify_tensors,
    write_artifact,
)
from kvhub.artifact.files import (
    AtomicDirectory,
    atomic_write_bytes,
    copy_regular,
    fsync_dir,
    fsync_tree,
    open_regular,
    regular_files,
    sha256_file,
)
from kvhub.artifact.metadata import (
    FORMAT_VERSION,
    METADATA_FILE,
    SUPPORTED_FORMAT_VERSIONS,
    TENSORS_FILE,
    check_format_version,
    check_metadata,
    canonical_json,
    config_geometry,
    is_plain_file_name,
    json_sha256,
    parse_json,
)
from kvhub.artifact.tensors import (
    TensorFile,
    check_tensors,
    format_version_of,
    has_target_means,
    is_compressed,
    map_prefix,
    read_tensor_file,
    tensor_name,
)

__all__ = [
    "CARD_FILE",
    "FIGURE_SUFFIXES",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "SUPPORTED_FORMAT_VERSIONS",
    "TENSORS_FILE",
    "AtomicDirectory",
    "TensorFile",
    "atomic_write_bytes",
    "canonical_json",
    "check_format_version",
    "check_metadata",
    "check_tensors",
    "config_geometry",
    "copy_regular",
    "format_version_of",
    "fsync_dir",
    "fsync_tree",
    "has_target_means",
    "is_compressed",
    "is_figure_name",
    "is_plain_file_name",
    "json_sha256",
    "map_prefix",
    "open_regular",
    "parse_json",
    "parse_metadata_bytes",
    "publishable_files",
    "read_artifact",
    "read_metadata",
    "read_tensor_file",
    "regular_files",
    "sha256_file",
    "tensor_name",
    "tensor_path",
    "verify_tensors",
    "write_artifact",
]
