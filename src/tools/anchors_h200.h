// Speeds measured on one H200 by others, copied from ../shared/anchors (reference_speed_h200.json,
// hf_transformers_speed_h200.json; random weights, DeepSeek-V2-Lite "16B" shape), so that the
// GPU benchmark prints its ratios without reading files outside the repository.
#pragma once

namespace dsv3::anchors {

// The card as the anchors measured it.
constexpr double kCopyGBps = 4261.393481314611;        // device-to-device copy, read + write
constexpr double kBf16MatmulTFlops = 797.9668265409288;

// deepseek-ai/DeepSeek-V3 inference/ (torch 2.11), one H200.
constexpr double kRefBf16DecodeB1 = 10.970204915404924;    // tokens/s
constexpr double kRefBf16DecodeB8 = 32.95248144092083;
constexpr double kRefBf16Prefill1024 = 1479.1627739936937;
// FP8 weights (inter_dim 10880), gemm_impl="bf16" (the shipped default): no batch-8 number.
constexpr double kRefFp8Bf16GemmDecodeB1 = 6.41068734748135;
constexpr double kRefFp8Bf16GemmPrefill1024 = 1653.7189676769328;
// FP8 weights, gemm_impl="fp8".
constexpr double kRefFp8DecodeB1 = 5.6554043203167215;
constexpr double kRefFp8DecodeB8 = 14.845876573861542;
constexpr double kRefFp8Prefill1024 = 1140.9851809357876;

// Hugging Face transformers 5.17 DeepseekV2ForCausalLM, bf16.
constexpr double kHfBf16DecodeB1 = 14.092903696002558;
constexpr double kHfBf16DecodeB8 = 93.50716019281204;
constexpr double kHfBf16Prefill1024 = 21564.495288354232;

}  // namespace dsv3::anchors
