"""Face data: synthetic generator, identity-folder and LFW-pairs readers, splits."""

from fl_secure.data.folders import load_identity_folders, load_image, natural_key
from fl_secure.data.lfw import (
    Pair,
    PairImages,
    PairsProtocol,
    image_path,
    load_pair_images,
    read_pairs,
)
from fl_secure.data.splits import (
    equal_partition,
    held_out_identities,
    identity_indices,
    stratified_split,
)
from fl_secure.data.synthetic import (
    AGE_BUCKETS,
    EXPRESSIONS,
    HAIR_COLOURS,
    SyntheticFaceConfig,
    generate_synthetic_faces,
)
from fl_secure.data.types import FaceDataset

__all__ = [
    "AGE_BUCKETS",
    "EXPRESSIONS",
    "HAIR_COLOURS",
    "FaceDataset",
    "Pair",
    "PairImages",
    "PairsProtocol",
    "SyntheticFaceConfig",
    "equal_partition",
    "generate_synthetic_faces",
    "held_out_identities",
    "identity_indices",
    "image_path",
    "load_identity_folders",
    "load_image",
    "load_pair_images",
    "natural_key",
    "read_pairs",
    "stratified_split",
]
