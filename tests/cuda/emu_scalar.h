// Host stand-ins of the CUDA scalar intrinsics and 16-bit conversions that both kernel
// emulators use (tests/cuda/kernel_emulator.h, tests/cuda/gemv_emulator.h): bit casts,
// rsqrtf, min, PRMT, IEEE binary16 / bfloat16 <-> float with round to nearest even (the
// PTX cvt instructions). Included once by either emulator, before the kernel source.
#pragma once
#include <cmath>
#include <cstring>

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline float __fmul_rn(float a, float b) { return a * b; }

// PRMT in its default mode: result byte n = byte (s >> 4n) & 7 of {y:x}.
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int n = 0; n < 4; ++n) {
        r |= (unsigned int)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    }
    return r;
}

inline float emu_half_to_float(unsigned short x) {
    _Float16 h;
    std::memcpy(&h, &x, 2);
    return (float)h;
}
inline unsigned short emu_float_to_half(float f) {
    _Float16 h = (_Float16)f;
    unsigned short x;
    std::memcpy(&x, &h, 2);
    return x;
}
inline unsigned short emu_float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
