"""DeviceMeshes whose replicate dimension is ft's replica group (torchft's ``torchft.device_mesh``).

HSDP with ft: inside a replica group the ranks shard the model with FSDP2 over ordinary torch
process groups; across replica groups the gradients are averaged by the Manager. Both are one
torch ``DeviceMesh`` here, so ``fully_shard(model, mesh=mesh)`` and DTensor ops use it unchanged::

    manager = ft.Manager(pg=ft.ProcessGroupGloo(), rank=group_rank, world_size=group_size, ...)
    mesh = ft_init_device_mesh(device_type="cpu", mesh_shape=(2, group_size),
                               mesh_dim_names=("dp_replicate", "dp_shard"), replicate_dim=0,
                               manager=manager)
    fully_shard(model, mesh=mesh)   # HSDP: Replicate() on dp_replicate, Shard(0) on dp_shard

How the mesh is built (torch 2.13): ``DeviceMesh.from_group`` takes one existing process group
per dimension. The dimensions other than the replicate one are torch's own groups, made by
``init_device_mesh`` over the replica group's default process group. The replicate dimension
is a :class:`ft.managed_process_group.ManagedProcessGroup` over the Manager, registered in torch's
group registry (``ProcessGroup.register``) so that DTensor's functional collectives find it by
name. Its collectives therefore go through :meth:`ft.Manager.allreduce`: a failure is reported
to the Manager (the step does not commit) instead of raised, and an average divides by the
replica groups taking part in the step, not by the size written in the mesh.

A DeviceMesh names every member by a rank of the default process group, which spans one
replica group only: the members of the other groups have no such rank. The mesh therefore
numbers them as if the groups were stacked (group ``k``'s rank ``r`` is ``r + k * world_size``),
and every process sits in row 0 of the replicate dimension. That coordinate is what DTensor
uses to decide which piece a rank holds, and on the replicate dimension every group holds the
same (``Replicate``) piece, so row 0 is right for all of them.

Limits (torch 2.13; see docs/design.md, "HSDP"):
  * The replicate dimension's size in the mesh is the ``mesh_shape`` entry given (a nominal
    count), fixed for the mesh's life; how many groups take part in a step is
    ``mesh.get_group(replicate_dim).size()`` (what FSDP2 divides gradients by). Place only
    ``Replicate`` (or ``Partial``, reduced by an allreduce) on it; ``Shard`` on it would give
    each group a slice sized for the nominal count.
  * ``_flatten`` of a submesh that includes the replicate dimension (and, by torch's code, FSDP2's
    integer ``reshard_after_forward``) makes torch create new groups over the stacked ranks,
    which do not exist: torch refuses ("Mesh should not be bigger than default world size").
  * With FSDP2, run the Manager with ``use_async_quorum=False``: the Manager reads the
    registered state on its quorum thread (to send a heal, and to check one it receives), and
    FSDP2's ``state_dict()`` reshards the module, which must not happen during a forward pass.

Differences from torchft: ``ft_init_device_mesh`` returns a real torch ``DeviceMesh`` (a
:class:`ManagedDeviceMesh`, a thin subclass), so torch's slicing, hashing and pickling apply
as they are; torchft's ``ManagedDeviceMesh`` re-implements DeviceMesh's methods and reports the
live number of groups as the replicate dimension's size.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ft.backend.process_group import ProcessGroup
from ft.managed_process_group import ManagedProcessGroup

if TYPE_CHECKING:
    from ft.manager import Manager

__all__ = ["ManagedDeviceMesh", "extend_device_mesh", "ft_init_device_mesh"]


def _stacked_ranks(inner: Optional[DeviceMesh], replicate_dim: int, size: int) -> torch.Tensor:
    """The mesh tensor: ``inner``'s ranks (or this rank alone) repeated ``size`` times along
    ``replicate_dim``, copy ``k`` offset by ``k * world_size`` (see the module docstring)."""
    world = dist.get_world_size()
    base = inner.mesh if inner is not None else torch.tensor(dist.get_rank(), dtype=torch.int)
    return torch.stack([base + k * world for k in range(size)], dim=replicate_dim)


class ManagedDeviceMesh(DeviceMesh):
    """A torch DeviceMesh whose dimension ``replicate_dim`` is ft's replica group.

    Contract:
      * It is a DeviceMesh built by torch's ``DeviceMesh.from_group``: dimension
        ``replicate_dim`` has ``replicate_pg`` as its group, the others ``mesh``'s groups, in
        ``mesh``'s order. Slicing, ``get_group``, ``get_coordinate``, hashing and pickling are
        torch's.
      * This process is at coordinate 0 of the replicate dimension; its coordinates on the
        other dimensions are its coordinates in ``mesh``.
      * The replicate dimension has ``replicate_size`` members in the mesh (a fixed, nominal
        count; default 1); the number taking part in a step is ``replicate_pg.size()``.

    Args (torchft's, then ft's):
        mesh: the DeviceMesh of the other dimensions; None for a mesh of the replicate
            dimension alone.
        mesh_dim_names: every dimension's name, the replicate one included.
        replicate_pg: the replicate dimension's group, registered in torch's group registry
            (:meth:`ft.backend.process_group.ProcessGroup.register`).
        replicate_dim: the replicate dimension's position.
        parent: kept as an attribute for torchft's callers; unused (torch's slicing makes
            submeshes here).
        replicate_size: the replicate dimension's size in the mesh.
        device_type: needed only when ``mesh`` and ``parent`` are both None.
    """

    def __init__(
        self,
        mesh: Optional[DeviceMesh],
        mesh_dim_names: Sequence[str],
        replicate_pg: Any,
        replicate_dim: int,
        parent: Optional[DeviceMesh] = None,
        replicate_size: int = 1,
        device_type: Optional[str] = None,
    ) -> None:
        names = tuple(mesh_dim_names)
        inner_ndim = mesh.ndim if mesh is not None else 0
        if len(names) != inner_ndim + 1:
            raise ValueError(
                f"mesh_dim_names {names} must name the {inner_ndim} dimension(s) of "
                f"mesh plus the replicate dimension"
            )
        if not 0 <= replicate_dim < len(names):
            raise ValueError(f"replicate_dim {replicate_dim} is out of range for {names}")
        if not isinstance(replicate_size, int) or replicate_size < 1:
            raise ValueError(f"replicate_size must be an int >= 1, got {replicate_size!r}")
        source = mesh if mesh is not None else parent
        device = source.device_type if source is not None else device_type
        if device is None:
            raise ValueError("ManagedDeviceMesh needs mesh, parent or device_type")
        groups: List[Any] = (
            [mesh.get_group(i) for i in range(inner_ndim)] if mesh is not None else []
        )
        groups.insert(replicate_dim, replicate_pg)
        # torch's public constructor for a mesh of existing groups builds the state; this
        # object takes it over (DeviceMesh keeps all of it in its instance dict). Always a
        # list: given one group alone, from_group wants the group's own ranks as the mesh.
        built = DeviceMesh.from_group(
            groups,
            device,
            mesh=_stacked_ranks(mesh, replicate_dim, replicate_size),
            mesh_dim_names=names,
        )
        self.__dict__.update(built.__dict__)
        self.replicate_dim = replicate_dim
        self.parent = parent

    @property
    def replicate_dim_name(self) -> str:
        return self.mesh_dim_names[self.replicate_dim]  # type: ignore[index]

    @property
    def replicate_pg(self) -> Any:
        """The replicate dimension's group (a :class:`ManagedProcessGroup` when made by
        :func:`ft_init_device_mesh`)."""
        return self.get_group(self.replicate_dim)


# (id(manager), dimension name) -> (manager, its group): one group per Manager and name, so
# that building the mesh again (or slicing a new one) does not register another group. The
# manager is kept with its id so that the id cannot be reused; torch's group registry keeps the
# group, and so the manager, alive anyway.
_managed: Dict[Tuple[int, str], Tuple[Any, ManagedProcessGroup]] = {}
_managed_lock = threading.Lock()


def _managed_group(manager: "Manager", name: str) -> ManagedProcessGroup:
    """The Manager's replicate group, registered in torch's registry under ``name``."""
    with _managed_lock:
        found = _managed.get((id(manager), name))
        if found is not None:
            return found[1]
        group = ManagedProcessGroup(manager)
        group.register(name)  # torch replaces an earlier backend of that name: no clash
        _managed[(id(manager), name)] = (manager, group)
        return group


def ft_init_device_mesh(
    *,
    device_type: str,
    mesh_shape: Union[Tuple[int, ...], List[int]],
    mesh_dim_names: Union[Tuple[str, ...], List[str]],
    replicate_dim: int,
    manager: "Manager",
) -> ManagedDeviceMesh:
    """A DeviceMesh of ``mesh_shape`` whose dimension ``replicate_dim`` is ``manager``'s
    replica group and whose other dimensions span this replica group (see the module
    docstring).

    The other dimensions are made by torch's ``init_device_mesh`` over the default process
    group, which must be (or is then, from the environment, as torch does) the replica group's
    own: their sizes multiply to its world size. ``mesh_shape[replicate_dim]`` is the
    replicate dimension's size in the mesh (see "Limits" above); torchft ignores it.
    """
    shape = [int(n) for n in mesh_shape]
    names = [str(n) for n in mesh_dim_names]
    if len(shape) != len(names):
        raise ValueError(
            f"mesh_shape {tuple(shape)} and mesh_dim_names {tuple(names)} differ in length"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be unique, got {tuple(names)}")
    if not -len(shape) <= replicate_dim < len(shape):
        raise ValueError(f"replicate_dim {replicate_dim} is out of range for {tuple(names)}")
    replicate_dim %= len(shape)
    replicate_size = shape.pop(replicate_dim)
    replicate_name = names.pop(replicate_dim)
    if not dist.is_initialized():
        dist.init_process_group()  # from the environment, as init_device_mesh would
    inner = (
        init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names)) if shape else None
    )
    group = _managed_group(manager, replicate_name)
    names.insert(replicate_dim, replicate_name)
    return ManagedDeviceMesh(
        inner,
        tuple(names),
        group,
        replicate_dim,
        replicate_size=max(1, replicate_size),
        device_type=device_type,
    )


def extend_device_mesh(mesh: DeviceMesh, pg: Any, name: str = "dp", dim: int = 0) -> DeviceMesh:
    """``mesh`` with one more dimension, ``name`` at position ``dim``, whose group is ``pg``
    (as torchft's: that dimension has size 1 in the mesh; scaling by the live number of
    members is the group's business). An ft group that is not in torch's registry yet is
    registered under ``name``."""
    if isinstance(pg, ProcessGroup) and getattr(pg, "_ft_group_name", None) is None:
        pg.register(name)
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    groups.insert(dim, pg)
    names = list(mesh.mesh_dim_names or [f"dim_{i}" for i in range(mesh.ndim)])
    names.insert(dim, name)
    return DeviceMesh.from_group(
        groups, mesh.device_type, mesh=mesh.mesh.unsqueeze(dim), mesh_dim_names=tuple(names)
    )
