"""Noise flooding of a CKKS decryption: the decrypted sum must not reveal the decryption error.

A CKKS decryption returns ``m + e``, not ``m``: whoever knows the ciphertext and the exact
output can subtract the encoded output and solve for the secret key (Li & Micciancio,
"On the security of homomorphic encryption on approximate numbers", EUROCRYPT 2021; the
IND-CPA^D notion). The decryptor therefore adds Gaussian noise, from a CSPRNG
(:class:`~privacy.dp.noise.SecureGaussian`), whose standard deviation is ``2**bits`` times a
bound on the error (Li, Micciancio, Schultz & Sorrell, "Securing approximate homomorphic
encryption using differential privacy", CRYPTO 2022, use the same statistical argument).

The bound (:func:`error_bound`), for a sum of ``n`` fresh symmetric-key ciphertexts (what the
clients upload; the aggregator refuses anything else): every coefficient of a fresh
ciphertext's error is at most :data:`NOISE_MAX_DEVIATION` (SEAL's centred binomial noise of
standard deviation 3.2 lies in [-21, 21]; its clipped Gaussian in [-19.2, 19.2]) plus 1/2 for
rounding the encoding, so the sum's error ``e`` has ``||e||_2 <= sqrt(N) n (21 + 1/2)``.
Decoding maps coefficients to ``N/2`` slots with ``||slots||_2 = sqrt(N/2) ||e||_2 / scale``
(half of the canonical embedding), and the real parts are no larger. Over ``c`` ciphertexts:

    B = sqrt(c) * N / sqrt(2) * n * 21.5 / scale.

Adding ``N(0, sigma^2)`` to every slot with ``sigma = 2**bits * B``, the output with the error
and without it are within statistical (total variation) distance
``||e|| / (2 sigma) <= 2**-(bits + 1)`` (Pinsker's inequality on the Gaussians' KL divergence
``||e||^2 / (2 sigma^2)``). At the default scale ``2**100`` this noise is ~1e-12 for a few
clients: the sum stays accurate to far below float32. A context made with a small scale
(``2**40``, the earlier default) would need noise of ~1e-1; :func:`flooding_std` refuses it
above :data:`MAX_FLOODING_STD` instead of quietly ruining the model.

Two decryptors each add fresh noise to the same sum; the server holds both answers, whose
mean carries noise of ``sigma / sqrt(2)``: the bound becomes ``2**-(bits + 1/2)``. A malicious
server may send the uploads to every survivor (a client cannot tell that it was not chosen):
the mean of ``n`` answers gives ``2**-(bits + 1 - log2(n) / 2)``, ``2**-37.7`` for 100 clients
at the default 40. The uploads are signed for one round id, which each client takes part in
only once, so no client opens the same sum twice.
"""

from __future__ import annotations

import math

from fl_secure.errors import PrivacyError
from privacy.ckks.context import Context, context_slots

#: Largest absolute value of a coefficient of SEAL's encryption noise (centred binomial of
#: standard deviation 3.2: the sum of 21 coin differences).
NOISE_MAX_DEVIATION = 21.0
#: Largest flooding standard deviation a decryptor adds (per value of the sum): above it the
#: context's scale is too small for the requested security (make the contexts again).
MAX_FLOODING_STD = 2.0**-20
#: The default statistical security parameter (``secure_aggregation.ckks_flooding_bits``).
DEFAULT_FLOODING_BITS = 40


def error_bound(degree: int, scale: float, summed: int, ciphertexts: int) -> float:
    """A bound on the L2 norm, over every decrypted value, of the error of a sum.

    Args:
        degree: The ring dimension ``N`` (``poly_modulus_degree``).
        scale: The ciphertexts' scale.
        summed: Fresh ciphertexts added into each ciphertext of the sum (the clients).
        ciphertexts: Ciphertexts of the sum (each holds ``N/2`` values).
    """
    per_coefficient = summed * (NOISE_MAX_DEVIATION + 0.5)
    return math.sqrt(ciphertexts) * degree / math.sqrt(2.0) * per_coefficient / scale


def flooding_std(ctx: Context, *, summed: int, ciphertexts: int, bits: int) -> float:
    """The standard deviation of the noise that floods the decryption of a sum.

    Args:
        ctx: A TenSEAL CKKS context (public or secret) of the ciphertexts.
        summed: Clients' ciphertexts in the sum.
        ciphertexts: Ciphertexts the sum spans.
        bits: Statistical security: the output's distance from an error-free one is at most
            ``2**-(bits + 1)``.

    Raises:
        PrivacyError: If the noise would exceed :data:`MAX_FLOODING_STD` (the context's scale
            is too small) or an argument is out of range.
    """
    if summed < 1 or ciphertexts < 0 or not 1 <= bits <= 128:
        raise PrivacyError(
            f"flooding needs summed >= 1, ciphertexts >= 0 and bits in 1..128, got {summed}, "
            f"{ciphertexts}, {bits}"
        )
    scale = float(ctx.global_scale)
    std = 2.0**bits * error_bound(2 * context_slots(ctx), scale, summed, ciphertexts)
    if std > MAX_FLOODING_STD:
        raise PrivacyError(
            f"noise flooding at {bits} bits would add noise of std {std:.3g} to the decrypted "
            f"sum of {summed} updates (scale 2^{math.log2(scale):g}), more than "
            f"{MAX_FLOODING_STD:.3g}: the CKKS contexts were made with too small a scale; make "
            "them again (`fl-secure certs ckks --overwrite`, scale 2^100) or lower "
            "secure_aggregation.ckks_flooding_bits"
        )
    return std
