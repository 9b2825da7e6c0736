"""Turn a Profile command into measurements: this node's layers and its share of link probes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.codecs import CODECS_BY_NAME
from hetlaunch.runtime.data_plane import init_data_plane, wire_device
from hetlaunch.runtime.devices import device_name, resolve_device
from hetlaunch.runtime.emulation import ComputeEmulation, WireEmulation
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.node_measurement import (CpuMeter, cipher_seconds_per_byte, codec_seconds_per_byte,
                                                probe_link, profile_layers, usable_memory_bytes)
from hetlaunch.runtime.wire import model_spec_from_proto

MAX_REPORTED_BANDWIDTH = 1e12  # a fit on a very fast link can come out unbounded; keep JSON finite


def run_profile(cmd: pb.Profile, store: wpb.StoreAccess) -> pb.ReportProfileRequest:
    if cmd.threads:
        torch.set_num_threads(cmd.threads)
    device = resolve_device(cmd.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report = pb.ReportProfileRequest(ok=True, device_name=device_name(device),
                                     memory_bytes=usable_memory_bytes(device, cmd.emulate.memory_gb,
                                                                                     cmd.memory_fraction))
    if cmd.measure_layers:
        spec = model_spec_from_proto(cmd.model)
        meter = CpuMeter()
        measured = profile_layers(spec, cmd.micro_batch_size, device, seed=cmd.seed,
                                  emulation=ComputeEmulation(cmd.emulate.speed or 1.0),
                                  precision=cmd.precision or "fp32", meter=meter)
        report.cpu_per_wall = meter.cpu_per_wall
        for m in measured:
            report.layers.append(pb.LayerProfile(seconds=m.seconds, optimizer_seconds=m.optimizer_seconds,
                                                  param_bytes=m.param_bytes, activation_bytes=m.activation_bytes,
                                                  output_bytes=m.output_bytes, input_grad_seconds=m.input_grad_seconds,
                                                  weight_grad_seconds=m.weight_grad_seconds))
        # Codecs run on a tensor the size of the largest boundary activation.
        biggest = max(m.output_bytes for m in measured[:-1] or measured)
        sample = torch.randn(max(biggest // 4, 1), device=device)
        report.codec_seconds_per_byte.update(codec_seconds_per_byte(sample))
        report.cipher_seconds_per_byte = cipher_seconds_per_byte(biggest)
    if cmd.HasField("rendezvous"):  # every agent joins the group, probing or not
        init_data_plane(cmd.rendezvous, store)
        try:
            wire = wire_device(device, cmd.rendezvous.backend)
            for probe in cmd.probes:
                link = Link(probe.peer_rank, CODECS_BY_NAME["none"], device, wire,
                            emulation=WireEmulation.from_spec(probe.emulate_bandwidth_mbps, probe.emulate_latency_ms))
                measured = probe_link(link, probe.initiator)
                if measured is not None:
                    latency, bandwidth = measured
                    report.links.append(pb.LinkProbe(peer_node=probe.peer_node, latency_s=latency,
                                                     bandwidth_bytes_per_s=min(bandwidth, MAX_REPORTED_BANDWIDTH)))
            # An agent with no probe (or done first) must not leave while the others still connect
            # their mesh or probe: its closed sockets fail them ("Connection closed by peer").
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return report
